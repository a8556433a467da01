"""A rank that finishes and exits while a peer is still inside init_process_group.

Rank 0 hosts the store (no launcher), sends one message and exits without
destroy_process_group. Rank 1's init is held open after it posted its part of each engine
agreement round until rank 0 has left init (a store key rank 0 sets), or 1 s if rank 0
cannot: before the fix rank 0 left and took the store with it while rank 1 still needed it;
now rank 0's init waits for rank 1's, and rank 1 reports its first call precisely.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from rankwise.testing._procs import free_port, run_ranks

pytestmark = pytest.mark.procs


def _program(rank: int, world: int, port: int) -> str:
    from datetime import timedelta

    import rankwise as dist
    from rankwise.api.world import current
    from rankwise.engines import select

    real = select.exchange

    def widened(store, key, value, size, me, timeout):  # type: ignore[no-untyped-def]
        if me != 1:
            return real(store, key, value, size, me, timeout)
        # rank 1 posts its value, then stays inside init until rank 0 has left its init
        # (or 1 s per round, if rank 0 cannot leave before this rank is done)
        store.set(f"{key}/{me}", value)
        try:
            store.wait(["test/rank0-left-init"], timedelta(seconds=1))
        except dist.DistTimeout:
            pass
        return real(store, key, value, size, me, timeout)

    select.exchange = widened
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=30)
    if rank == 0:
        current().rendezvous.set("test/rank0-left-init", "1")
        dist.send(np.ones(1), dst=1, tag=1)
        sys.stdout.flush()
        os._exit(0)  # finishes without destroy_process_group
    try:
        dist.recv(np.zeros(1), src=0, tag=2)
    except dist.DistError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "received"


def test_rank_exiting_after_init_does_not_fail_a_peer_still_in_init() -> None:
    results = run_ranks(_program, 2, args=(free_port(),), init=False, timeout=60)
    one = next(r for r in results if r.rank == 1)
    assert one.error_type is None, one.traceback
    assert "init_process_group" not in str(one.value), one.value
    assert "tag" in str(one.value), one.value
