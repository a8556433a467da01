"""Synchronisation helpers that cannot fall into the seed-000 trap silently.

``rank_zero_first`` is the "rank 0 builds the dataset/cache first" context manager
that every training codebase writes by hand out of two barriers. Hand-written, its
barriers pair with *any* barrier, so a call from a rank-0-only branch is released by
an unrelated barrier later and the job runs on out of step. Here the block's barrier
carries its own fingerprint (a marked root and the name of the ``with`` line), so it
only pairs with the same block on the other ranks; anything else is a
``CollectiveMismatch`` naming the trap and the fix. The other ranks wait for rank 0's
block at most the group's timeout (``timeout=`` raises it for a long download): if rank 0
dies, raises or leaves they get ``PeerFailure`` at once; if it hangs (deadlock, SIGSTOP)
they get ``DistTimeout`` with the who-is-where report when the timeout passes. An
unbounded wait here once left a job hanging forever behind a frozen rank 0.

``monitored_barrier`` is torch's debugging barrier: rank 0 collects an
acknowledgement from every rank within ``timeout`` and names the ranks that did not
come, with where they are.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np

from ..api.path import launch
from ..api.world import resolve_group
from ..checks.report import rank_list
from ..core.group import seconds
from ..engines.base import Call, Engine
from ..errors import DistError, DistTimeout
from ..identity.calls import barrier_name_code
from ..identity.callsite import capture
from ..wire.frames import Flag, Op

__all__ = ["main_process_first", "monitored_barrier", "rank_zero_first"]


def _is_leader(group_rank: int, local: bool) -> bool:
    if local:
        raw = os.environ.get("LOCAL_RANK")
        if raw is not None and raw.strip().lstrip("-").isdigit():
            return int(raw) == 0
    return group_rank == 0


@contextmanager
def rank_zero_first(group: Any = None, local: bool = False,
                    timeout: timedelta | float | None = None) -> Iterator[None]:
    """Rank 0 of ``group`` runs the block first; the other ranks run it once rank 0 is
    done (to read the cache it built). ``local=True``: the first rank of each node
    (``LOCAL_RANK == 0``) leads instead.

    Every rank of the group must enter the block. Waiting ranks wait up to ``timeout``
    (default: the group's timeout) for rank 0 to finish it, then raise ``DistTimeout``
    with the who-is-where report; if rank 0 raises inside they get ``PeerFailure`` with
    its traceback at once; if only some ranks enter, every rank gets an error naming
    the trap.
    """
    g = resolve_group(group)
    if g is None or g.size() == 1:
        yield
        return
    limit = seconds(timeout, g.timeout)
    if limit <= 0:
        raise DistError(f"rank_zero_first timeout must be positive, got {timeout!r}")
    site = capture()  # the user's `with` line: the block's identity on every rank
    first = site.first
    label = (f"rank_zero_first@{os.path.basename(first[0])}:{first[1]}"
             if first is not None else "rank_zero_first")
    code = barrier_name_code(label)
    if _is_leader(g.group_rank, local):
        try:
            yield
        except BaseException as exc:
            _leader_failed(g, exc, label)
            raise
        _block_barrier(g, code, None)
    else:
        try:
            _block_barrier(g, code, limit)
        except DistTimeout as exc:
            where = label.partition("@")[2] or "?"
            leader = "the first rank of this node" if local else f"rank {g.ranks[0]}"
            raise DistTimeout(
                f"rank {g.comm.rank} waited {limit:g}s in rank_zero_first at {where} for "
                f"{leader} to finish the block, and it did not (hung, stopped or deadlocked "
                "inside it: see the report). If the block legitimately takes longer, pass "
                "rank_zero_first(timeout=...)", report=exc.report) from None
        yield


#: Hugging Face's name for the same helper
main_process_first = rank_zero_first


def _block_barrier(g: Any, code: int, limit: float | None) -> None:
    """The block's barrier; ``limit``: the followers' bound on the wait for the leader,
    who works on purpose meanwhile (so no slow-wait warning before that bound)."""
    def body(engine: Engine, call: Call) -> None:
        if limit is not None:
            call.deadline = time.monotonic() + limit
            call.patient = True
        engine.barrier(call)

    launch(g, Op.barrier, None, code, None, 0, body, False, flags=Flag.SYNC)


def _leader_failed(g: Any, exc: BaseException, label: str) -> None:
    """Tell the waiting ranks now (with the traceback), and poison this rank: the job
    cannot go on with rank 0's block half done."""
    comm = g.comm
    if comm.closed or comm.router.failure is not None:
        return
    where = label.partition("@")[2] or "?"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = (f"{type(exc).__name__}: {exc} (raised on rank {comm.rank} inside "
               f"rank_zero_first at {where}, while the other ranks waited for its block)")
    comm.broadcast_abort({"kind": "exception", "rank": comm.rank, "message": message[:4000],
                          "traceback": text[-40000:], "last": comm.last_call})
    comm.router.fail_all(DistError(
        f"rank {comm.rank} raised inside rank_zero_first at {where}; the other ranks were "
        f"told and this rank can no longer communicate: {type(exc).__name__}: {exc}"))


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """torch's ``monitored_barrier``: rank 0 waits up to ``timeout`` for every rank and
    raises ``DistTimeout`` naming the ranks that did not arrive (all of them, whatever
    ``wait_all_ranks`` says: the deadline is shared, so naming them costs nothing), with
    a who-is-where table. The ranks that did arrive get an error naming them too.
    """
    g = resolve_group(group)
    if g is None:
        return
    limit = seconds(timeout, g.timeout)
    if limit <= 0:
        raise DistError(f"monitored_barrier timeout must be positive, got {timeout!r}")
    site = capture()

    def body(engine: Engine, call: Call) -> None:
        # per-peer messages with per-rank deadlines: always on the message engine
        link = g.messages.link(call)
        n, r = link.size, link.rank
        if r != 0:
            link.send(0, np.zeros(1, np.uint8), 0)
            verdict = np.zeros(n, np.uint8)
            link.wait(link.post(0, verdict, 1))
            if verdict.any():
                missing = [g.ranks[i] for i in range(n) if verdict[i]]
                raise DistTimeout(
                    f"monitored_barrier at {site.short} failed: rank {g.ranks[0]} reports "
                    f"that {rank_list(missing)} did not reach it within {limit:g}s")
            return
        link.quiet = True
        link.deadline = time.monotonic() + limit
        acks = {i: link.post(i, np.zeros(1, np.uint8), 0) for i in range(1, n)}
        missing = []
        for i, h in acks.items():
            try:
                link.wait(h)
            except DistTimeout:
                missing.append(i)
        verdict = np.zeros(n, np.uint8)
        verdict[missing] = 1
        link.deadline = time.monotonic() + g.timeout
        for i in range(1, n):
            if i not in missing:
                link.send(i, verdict, 1)
        if missing:
            names = [g.ranks[i] for i in missing]
            table = g.comm.where_table(f"monitored_barrier at {site.short} on rank "
                                       f"{g.ranks[0]}")
            raise DistTimeout(
                f"monitored_barrier at {site.short} (collective #{link.seq} of {g.name}): "
                f"{rank_list(names)} did not reach it within {limit:g}s", report=table)

    launch(g, Op.monitored_barrier, None, 0, None, 0, body, False, engine=g.messages)
