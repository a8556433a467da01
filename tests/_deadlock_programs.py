"""Deadlocked (and merely slow) programs for ``test_deadlock.py``; not tests themselves.

Run as ``python tests/_deadlock_programs.py CASE`` in one process per rank (env:// init),
so an uncaught exception goes through ``sys.excepthook`` as in a user's job. Each rank
prints ``BLOCKING <t>`` just before the call that blocks for good and ``RAISED <t>`` when
that call raises (wall-clock seconds), so the tests can bound the detection time. Lines
the tests assert on carry an ``# @marker`` comment (``line_of``).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diagnosis_programs import _busy


def _blocking() -> None:
    print(f"BLOCKING {time.time():.3f}", flush=True)


def cross_group(dist, rank, world):
    """Ranks 0-2 wait in a barrier of a sub-group of all ranks; rank 3 skipped it and
    waits in an all_reduce of WORLD: nobody can proceed. ``LATE`` s of computing on rank
    3 first make it the last rank to block."""
    sub = dist.new_group(list(range(world)))
    t = np.ones(4, np.float32)
    dist.all_reduce(t)
    if rank == world - 1:
        _busy(float(os.environ.get("LATE", "0")))
        _blocking()
        dist.all_reduce(t)  # rank 3 skipped the barrier  @cross-all-reduce
    else:
        _blocking()
        dist.barrier(group=sub)  # @cross-barrier


def recv_cycle(dist, rank, world):
    """Every rank receives from the next one first: a cycle of blocking recvs."""
    t = np.zeros(4, np.float32)
    _blocking()
    dist.recv(t, src=(rank + 1) % world)  # @ring-recv
    dist.send(t, dst=(rank - 1) % world)


def busy_peer_ok(dist, rank, world):
    """Correct: rank 1 computes (GIL held) for ``LATE`` s while the others wait in a
    barrier and in a recv it satisfies afterwards: slow, never a deadlock."""
    t = np.ones(4, np.float32)
    if rank == 1:
        _busy(float(os.environ.get("LATE", "3")))
        dist.send(t, dst=0)
    elif rank == 0:
        dist.recv(t, src=1)
    dist.barrier()
    print("OK", flush=True)


def irecv_ok(dist, rank, world):
    """Correct: rank 0 posts an irecv, then waits in a barrier; rank 1 computes, joins the
    barrier and only then sends what the irecv takes; async all_reduces stay in flight
    while their callers compute."""
    t = np.zeros(4, np.float32)
    if rank == 0:
        work = dist.irecv(t, src=1)
        dist.barrier()
        work.wait()
        assert t[0] == 7.0
    else:
        time.sleep(1.5)
        dist.barrier()
        dist.send(np.full(4, 7.0, np.float32), dst=0)
    u = np.ones(4, np.float32)
    w = dist.all_reduce(u, async_op=True)
    if rank == 0:
        _busy(2.0)
    w.wait()
    assert u[0] == world
    print("OK", flush=True)


CASES = {f.__name__: f for f in (cross_group, recv_cycle, busy_peer_ok, irecv_ok)}


def main() -> None:
    import rankwise as dist

    case = CASES[sys.argv[1]]
    dist.init_process_group("gloo")
    try:
        case(dist, dist.get_rank(), dist.get_world_size())
    except dist.DistError:
        print(f"RAISED {time.time():.3f}", flush=True)
        raise
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
