"""A job that trains a few steps and then deadlocks: for the live page (docs/live.md).

    RANKWISE_DEADLOCK_AFTER=5 python -m rankwise run -n 4 examples/live_deadlock.py

Every rank all_reduces for ``STEPS`` steps; then the last rank skips the barrier of a
sub-group that all the others enter, and waits in the next all_reduce of WORLD. Nobody
can go on. Open the address the launcher prints: the stuck ranks turn red with their
file:line, then the ``DeadlockError`` report appears (rankwise finds the cycle after
``RANKWISE_DEADLOCK_AFTER`` seconds, default 1).
"""

from __future__ import annotations

import os
import time

import numpy as np

import rankwise as dist

STEPS = int(os.environ.get("STEPS", "20"))


def main() -> None:
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(range(world)))
    grad = np.ones(1024, np.float32)
    for _ in range(STEPS):
        time.sleep(0.05)  # the "forward and backward"
        dist.all_reduce(grad)
    print(f"rank {rank}: STUCK {time.time():.3f}", flush=True)
    if rank == world - 1:
        dist.all_reduce(grad)  # the last rank skipped the barrier  @skipped
    else:
        dist.barrier(group=sub)  # the others wait for it here  @waits
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
