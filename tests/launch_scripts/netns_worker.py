"""A rank for the simulated-host tests: all_reduce in a loop, telling the test where it is.

Argv: MODE SECONDS. MODE ``loop``: all_reduce of ``[rank+1]`` for SECONDS (of the fastest rank),
each result checked; ``busy``: rank 3 computes in pure Python for SECONDS while the others wait in a
barrier. Prints ``ready <rank> <pid>`` once the group works, ``done <rank> <calls>`` at the end,
and on an error ``raised <rank> <monotonic> <type>: <message>``.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

import rankwise as dist


def main() -> int:
    mode, seconds = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("tcp")
    rank, world = dist.get_rank(), dist.get_world_size()
    expect = world * (world + 1) / 2
    try:
        buf = np.array([rank + 1.0])
        dist.all_reduce(buf)
        print(f"ready {rank} {os.getpid()} {socket.gethostname()}", flush=True)
        end = time.monotonic() + seconds
        n = 0
        if mode == "busy":
            dist.barrier()
            if rank == world - 1:
                x = 0
                while time.monotonic() < end:
                    x += 1
            dist.barrier()
        while mode == "loop":
            # the second element: ranks whose time is up; all stop on the same call
            buf = np.array([rank + 1.0, float(time.monotonic() >= end)])
            dist.all_reduce(buf)
            if buf[0] != expect:
                raise AssertionError(f"rank {rank}: all_reduce gave {buf[0]}, not {expect}")
            n += 1
            if buf[1]:
                break
            time.sleep(0.01)
        print(f"done {rank} {n}", flush=True)
    except dist.DistError as exc:
        print(f"raised {rank} {time.monotonic():.3f} {type(exc).__name__}: {exc}", flush=True)
        raise
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
