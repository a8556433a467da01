"""A rank for the late-node test: attempt 0 waits for the test's ``release`` key, then fails
(so the job restarts); later attempts form the group and check an all_reduce across it.

Prints ``WAITING <rank>`` in attempt 0 and ``JOINED <rank> <world> <sum>`` afterwards.
Argument ``ok``: attempt 0 succeeds once released (the job ends without a restart).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import numpy as np

import rankwise as dist
from rankwise.store import TCPStore


def main() -> int:
    if os.environ["RANKWISE_RESTART_COUNT"] == "0":
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         timeout=timedelta(seconds=30))
        print(f"WAITING {os.environ['RANK']}", flush=True)
        store.wait(["release"], timeout=timedelta(seconds=20))
        return 0 if sys.argv[1:] == ["ok"] else 3
    dist.init_process_group("tcp")
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = np.array([rank + 1.0])
    dist.all_reduce(buf)
    print(f"JOINED {rank} {world} {buf[0]:g}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
