"""Root disagreement (issue 12, item 1): a rank that believes it is the root of a broadcast
or scatter only sends, and a root of reduce or gather only receives, so neither sees the
contradiction on its own. Every rank of a mismatched root-based call must raise
``CollectiveMismatch`` from that very call: never exit 0 holding different data, never
only some ranks, never a misleading "Broken pipe".

Each case runs a few fresh jobs in a row so that a race between "the root returned" and
"a peer found the mismatch" shows up.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.testing import run_ranks

pytestmark = pytest.mark.procs

REPEATS = int(os.environ.get("RANKWISE_ROOT_REPEATS", "2"))  #: fresh jobs per pattern


def _root_call(rank: int, world: int, op: str, pattern: str) -> Any:
    # "self": every rank names itself as the root; "odd": the last rank names itself,
    # the others name rank 0
    root = rank if pattern == "self" or rank == world - 1 else 0
    t = np.full(4, rank + 1, np.float32)
    if op == "broadcast":
        dist.broadcast(t, src=root)
    elif op == "scatter":
        parts = [np.full(4, 10 * rank + i, np.float32) for i in range(world)]
        dist.scatter(t, parts if rank == root else None, src=root)
    elif op == "reduce":
        dist.reduce(t, dst=root)
    elif op == "gather":
        slots = [np.zeros(4, np.float32) for _ in range(world)]
        dist.gather(t, slots if rank == root else None, dst=root)
    else:
        raise AssertionError(op)
    return t.tolist()  # returning at all means the mismatch went unnoticed by this rank


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op", ["broadcast", "scatter", "reduce", "gather"])
def test_every_rank_raises_from_the_mismatched_call(op: str, world: int) -> None:
    patterns = ["self", "odd"] if world > 2 else ["self"]
    for attempt in range(REPEATS):
        for pattern in patterns:
            results = run_ranks(_root_call, world, args=(op, pattern), timeout=90,
                                init_kwargs={"timeout": 30.0})
            for r in results:
                assert r.raised("CollectiveMismatch"), (
                    f"{op} {pattern} run {attempt}: rank {r.rank} "
                    f"{'returned ' + repr(r.value) if r.error_type is None else r.error_type}: "
                    f"{r.message}")
                assert op in r.message, r.message
                # found by the frames, not by the hang-time check at the timeout
                assert r.elapsed < 15.0, (r.rank, r.elapsed)


def _agreeing(rank: int, world: int) -> Any:
    out = []
    for root in range(world):
        t = np.full(3, rank + 1, np.float32)
        dist.broadcast(t, src=root)
        out.append(t.tolist())
        parts = [np.full(3, 10 * i, np.float32) for i in range(world)]
        dist.scatter(t, parts if rank == root else None, src=root)
        out.append(t.tolist())
        t = np.full(3, rank + 1, np.float32)
        dist.reduce(t, dst=root)
        out.append(t.tolist() if rank == root else None)
        slots = [np.zeros(3, np.float32) for _ in range(world)]
        dist.gather(np.full(3, rank, np.float32), slots if rank == root else None, dst=root)
        out.append([s.tolist() for s in slots] if rank == root else None)
    return out


def test_agreeing_root_calls_still_work() -> None:
    world = 3
    results = run_ranks(_agreeing, world, timeout=90)
    for r in results:
        assert r.ok, r.message + r.traceback
    total = float(sum(range(1, world + 1)))
    for r in results:
        for root in range(world):
            bcast, scat, red, gath = r.value[4 * root:4 * root + 4]
            assert bcast == [root + 1.0] * 3
            assert scat == [10.0 * r.rank] * 3
            if r.rank == root:
                assert red == [total] * 3
                assert gath == [[float(i)] * 3 for i in range(world)]
