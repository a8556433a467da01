"""Header flags (``wire.frames.Flag``): markers carried in the ``flags`` byte, not in magic
values of other fields.

- a call flag (``SYNC``, the barrier of a rank-0-first block; ``DEVICE``, CUDA tensors on
  a group whose NCCL plane moves them) is part of the call's identity: a frame without it
  never matches a call with it, even when every other field agrees;
- a lane flag (``CTS``, ``GATHER``, ``CHECK``) keeps a message apart from the data step
  of the same number from the same peer;
- unknown flag bits are refused by the decoder;
- end to end, the ring's clear-to-send and the large reduce's gather (both lanes) give
  exact results where their step 0 meets data step 0 of the same neighbour (2 ranks),
  and the rank-0-first trap is named from the flag that crossed the wire.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.algorithms import ring, tree
from rankwise.algorithms.link import Lane
from rankwise.core import messages as message
from rankwise.core.messages import OpLink
from rankwise.core.router import Router
from rankwise.identity.calls import (
    Fingerprint,
    barrier_name_code,
    describe,
    flags_shown,
    mismatch_advice,
)
from rankwise.testing.threads import ThreadRankError, run_threads
from rankwise.wire.frames import Flag, Frame, Kind, Op, WireError, decode_header, encode_header


def _frame(src: int, flags: int = 0, step: int = 0, count: int = 0, n: int = 0,
           op: Op = Op.barrier, dtype: int = 0, reduce: int = 0) -> Frame:
    return decode_header(encode_header(Kind.COLL, group=0, seq=1, op=op, dtype=dtype,
                                       reduce=reduce, flags=flags, count=count, step=step,
                                       payload_len=n), src=src)


def _router() -> tuple[Router, list[tuple[Frame, Any]]]:
    seen: list[tuple[Frame, Any]] = []
    return Router(lambda frame, fp, _detail: seen.append((frame, fp))), seen


def test_a_call_flag_is_part_of_the_identity() -> None:
    code = barrier_name_code("rank_zero_first@x.py:1")
    sync = Fingerprint(int(Op.barrier), 0, 0, int(Flag.SYNC), 0, code)
    router, mismatches = _router()
    router.register_call(0, 1, sync)
    router.post_coll((0, 1, 1, 0, 0), memoryview(bytearray()))
    buf, _token = router.on_header(_frame(1, flags=0, count=code))  # same fields, no SYNC
    assert buf is None and len(mismatches) == 1 and mismatches[0][1] == sync

    router, mismatches = _router()
    router.register_call(0, 1, sync)
    pending = router.post_coll((0, 1, 1, 0, 0), memoryview(bytearray()))
    frame = _frame(1, flags=Flag.SYNC, count=code)
    buf, token = router.on_header(frame)
    assert buf is not None and not mismatches
    router.on_payload(frame, token)  # type: ignore[arg-type]
    assert pending.completed and pending.error is None


def test_the_device_flag_is_part_of_the_identity_and_shown() -> None:
    """A CUDA call on a two-plane group and the same call on host memory: a mismatch,
    described so that the reader sees which side is which, with advice that names the
    devices (also when the two calls are known only as text, from who-is-where reports)."""
    cuda = Fingerprint(int(Op.all_reduce), 11, 1, int(Flag.DEVICE), 0, 4)
    host = cuda._replace(flags=0)
    router, mismatches = _router()
    router.register_call(0, 1, cuda)
    router.post_coll((0, 1, 1, 0, 0), memoryview(bytearray(16)))
    buf, _token = router.on_header(_frame(1, op=Op.all_reduce, dtype=11, count=4, reduce=1))
    assert buf is None and len(mismatches) == 1 and mismatches[0][1] == cuda
    assert describe(cuda).endswith(") on CUDA") and not describe(host).endswith("on CUDA")
    assert flags_shown(describe(cuda)) == Flag.DEVICE and flags_shown(describe(host)) == 0
    assert "One side passed CUDA tensors" in mismatch_advice(int(Flag.DEVICE), 0)
    assert "CUDA" not in mismatch_advice(int(Flag.DEVICE), int(Flag.DEVICE))


def test_lanes_keep_step_zero_apart() -> None:
    router, mismatches = _router()
    router.register_call(0, 1, Fingerprint(int(Op.barrier), 0, 0, 0, 0, 0))
    data = router.post_coll((0, 1, 1, 0, 0), memoryview(bytearray()))
    cts = router.post_coll((0, 1, 1, 0, int(Flag.CTS)), memoryview(bytearray()))
    frame = _frame(1, flags=Flag.CTS)
    buf, token = router.on_header(frame)
    assert buf is not None
    router.on_payload(frame, token)  # type: ignore[arg-type]
    assert cts.completed and not data.completed and not mismatches
    frame = _frame(1)
    buf, token = router.on_header(frame)
    router.on_payload(frame, token)  # type: ignore[arg-type]
    assert data.completed and data.error is None and not mismatches


def test_unknown_flag_bits_are_refused() -> None:
    for flags in (0x04, 0x80, 0xFF):
        with pytest.raises(WireError, match="unknown flag bits"):
            decode_header(encode_header(Kind.COLL, op=Op.all_reduce, flags=flags))
    for flag in Flag:
        assert decode_header(encode_header(Kind.COLL, op=Op.all_reduce, flags=flag)).flags == flag


def _lanes(rank: int, n: int) -> tuple[bool, bool]:
    count = n * max(ring.CTS_BYTES, tree.LARGE_REDUCE) // 4 + 3  # chunks big enough for CTS
    x = np.full(count, rank + 1, np.float32)
    dist.all_reduce(x)  # ring (threshold) with a clear-to-send on step 0
    y = np.full(count, rank + 1, np.float32)
    dist.reduce(y, dst=1)  # reduce-scatter, then the GATHER lane to the root
    total = n * (n + 1) // 2
    return bool((x == total).all()), rank != 1 or bool((y == total).all())


@pytest.mark.parametrize("n", [2, 3])
def test_cts_and_gather_lanes_give_exact_results(n: int, monkeypatch: Any) -> None:
    lanes: set[Lane] = set()
    send = OpLink.send

    def spy(self: OpLink, peer: int, data: Any, step: int, lane: Lane = Lane.DATA) -> None:
        lanes.add(lane)
        send(self, peer, data, step, lane)

    monkeypatch.setattr(OpLink, "send", spy)
    monkeypatch.setattr(message, "ALLREDUCE_ALGORITHM", "ring")  # 2 ranks: not halving
    assert run_threads(_lanes, n, timeout=120, op_timeout=60) == [(True, True)] * n
    assert lanes == ({Lane.DATA, Lane.CTS} if n == 2 else set(Lane))  # GATHER needs n > 2


def _trap(rank: int, n: int) -> None:
    if rank == 0:
        with dist.rank_zero_first():
            pass
    else:
        dist.barrier()


def test_the_trap_is_named_from_the_flag_on_the_wire() -> None:
    with pytest.raises(ThreadRankError) as info:
        run_threads(_trap, 2, timeout=60, op_timeout=20)
    for rank in (0, 1):
        text = str(info.value.errors[rank])
        assert "rank-0-first trap" in text, text
        assert "rank_zero_first(" in text, text
