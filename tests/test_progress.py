"""Who reads the sockets: large blocking collectives read for themselves (transport drive)
while the I/O thread parks; everything else relies on the I/O thread.

The hand-over must never lose a frame or stall a rank: several threads of one process
run collectives at once (an async worker and the main thread, two user threads on two
groups), so one of them reads for the others, and two threads can send to one peer at
the same time. Every result is checked exactly (integers).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.testing import run_ranks

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

LARGE = 300_001  #: int32 elements: above the drive threshold (256 KiB)


def _expected(world: int, scale: int, n: int) -> np.ndarray[Any, Any]:
    """Sum over ranks r of (arange(n) + r) * scale."""
    base = np.arange(n, dtype=np.int64) * world + world * (world - 1) // 2
    return (base * scale).astype(np.int32)


def _mixed(rank: int, world: int, rounds: int) -> list[str]:
    problems = []
    for i in range(rounds):
        a = (np.arange(LARGE, dtype=np.int32) + rank) * 1
        b = (np.arange(LARGE, dtype=np.int32) + rank) * 2
        small = np.full(3, rank + i, np.int32)
        work = dist.all_reduce(a, async_op=True)  # the worker thread may drive
        dist.all_reduce(b)  # ... while the main thread waits, or drives itself
        dist.all_reduce(small)
        assert work is not None
        work.wait()
        if not np.array_equal(a, _expected(world, 1, LARGE)):
            problems.append(f"round {i}: async all_reduce wrong")
        if not np.array_equal(b, _expected(world, 2, LARGE)):
            problems.append(f"round {i}: sync all_reduce wrong")
        if small.tolist() != [world * i + world * (world - 1) // 2] * 3:
            problems.append(f"round {i}: small all_reduce wrong: {small}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_async_and_sync_large_collectives_overlap(world: int) -> None:
    results = run_ranks(_mixed, world, args=(4,), timeout=100)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        assert r.value == [], r.value


def _two_threads(rank: int, world: int, rounds: int) -> list[str]:
    """Two user threads, each with its own group over the same ranks, run large
    collectives at the same time: both send to the same peers concurrently."""
    groups = [dist.new_group(list(range(world))), dist.new_group(list(range(world)))]
    problems: list[str] = []
    errors: list[BaseException] = []

    def body(k: int) -> None:
        try:
            for i in range(rounds):
                t = (np.arange(LARGE, dtype=np.int32) + rank) * (k + 1)
                dist.all_reduce(t, group=groups[k])
                if not np.array_equal(t, _expected(world, k + 1, LARGE)):
                    problems.append(f"thread {k} round {i}: wrong result")
                g = np.full(LARGE // 2, rank * 10 + k, np.int32)
                out = [np.empty_like(g) for _ in range(world)]
                dist.all_gather(out, g, group=groups[k])
                if [int(o[0]) for o in out] != [r * 10 + k for r in range(world)]:
                    problems.append(f"thread {k} round {i}: wrong all_gather")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    if any(t.is_alive() for t in threads):
        problems.append("a thread is still running after 90s")
    problems += [f"{type(e).__name__}: {e}" for e in errors]
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_two_threads_on_two_groups_at_once(world: int) -> None:
    # small socket buffers: sends often wait for room, and a thread reading for both
    # may find the other thread holding the send lock to a peer (it keeps reading)
    results = run_ranks(_two_threads, world, args=(4,), timeout=100,
                        env={"RANKWISE_SOCKBUF": str(64 << 10)})
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        assert r.value == [], r.value
