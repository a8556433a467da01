"""``core.group.begin_call``: the device hot path's ``ProcessGroup.begin`` in C
(``_begin.c``) registers the same call as the Python method, or hands back None while the
job has a failure (the method then explains it). Thread-ranks over the memory transport."""

from __future__ import annotations

import time
from typing import Any

import pytest

import rankwise as rw
from rankwise.api.world import resolve_group
from rankwise.core import group as group_module
from rankwise.identity.calls import Fingerprint
from rankwise.identity.callsite import capture
from rankwise.testing.threads import run_threads
from rankwise.wire.frames import Op

needs_c = pytest.mark.skipif(group_module.begin_call is group_module._begin_in_python,
                             reason="the C module was not built")

_FIELDS = ("group", "fp", "site", "dtype", "op", "shape", "label", "finished", "patient",
           "quiet", "inline", "waiting_for", "enqueued", "engine")


@needs_c
def test_the_c_begin_registers_what_the_method_registers() -> None:
    def body(rank: int, size: int) -> str:
        g = resolve_group(None)
        assert g is not None
        fp = Fingerprint(Op.all_reduce, 1, 4, 0, 0)
        site = capture(1)
        seq = g.seq
        before = time.monotonic()
        ours = group_module.begin_call(g, fp, site, None, None, (4,), False)
        theirs = g.begin(fp, site, None, None, False, (4,))
        assert ours is not None
        assert (ours.seq, theirs.seq, g.seq) == (seq + 1, seq + 2, seq + 2)
        for name in _FIELDS:
            assert getattr(ours, name) == getattr(theirs, name), name
        assert before + g.timeout <= ours.deadline <= theirs.deadline
        assert abs(ours.started - time.time()) < 60
        assert list(g.history)[-2:] == [ours, theirs]
        with rw.record_comm("bucket 3"):  # the context's label, as the method reads it
            labelled = group_module.begin_call(g, fp, site, None, None, None, False)
        assert labelled is not None and labelled.label == "bucket 3"
        registered: list[tuple[Any, ...]] = []
        router = g.comm.router
        router.register_call = lambda *args: registered.append(args)  # type: ignore[method-assign]
        framed = group_module.begin_call(g, fp, site, None, None, None, True)
        assert framed is not None and registered == [(g.id, framed.seq, fp)]
        del router.register_call
        for _ in range(3):  # the ranks' sequence numbers stay in step for what follows
            g.seq -= 1
            g.history.pop()
        rw.barrier()
        return "ok"

    assert run_threads(body, 2) == ["ok", "ok"]


@needs_c
def test_with_a_failure_the_c_begin_hands_over_to_the_method() -> None:
    def body(rank: int, size: int) -> str:
        g = resolve_group(None)
        assert g is not None
        router = g.comm.router
        seq = g.seq
        router.failure = RuntimeError("a peer failed")
        try:
            got = group_module.begin_call(g, Fingerprint(Op.barrier, 0, 0, 0, 0), capture(1),
                                          None, None, None, False)
        finally:
            router.failure = None
        assert got is None and g.seq == seq  # nothing registered, nothing numbered
        rw.barrier()
        return "ok"

    assert run_threads(body, 2) == ["ok", "ok"]
