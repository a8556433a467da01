"""A rank for the simulated-host tests: all_reduce in a loop, telling the test where it is.

Argv: MODE SECONDS. MODE ``loop``: all_reduce of ``[rank+1]`` for SECONDS (of the fastest
rank), each result checked; ``large``: the same, each call followed by a checked 512 KiB one
(the tiered engine's path: shared memory within a host, tcp between hosts); ``busy``: rank 3
computes in pure Python for SECONDS while the others wait in a barrier; ``gil``: the same,
but rank 3 holds the GIL for SECONDS in one C call (libc's ``sleep`` through ``ctypes.PyDLL``,
which keeps the GIL: no other thread of it runs, its heartbeats included). Prints
``ready <rank> <pid> <host> <engine>`` once the group works, ``done <rank> <calls>`` at the
end, and on an error ``raised <rank> <monotonic> <type>: <message>``.
"""

from __future__ import annotations

import ctypes
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
        engine = dist.group.WORLD.engine_name()
        print(f"ready {rank} {os.getpid()} {socket.gethostname()} {engine}", flush=True)
        end = time.monotonic() + seconds
        n = 0
        if mode == "busy":
            dist.barrier()
            if rank == world - 1:
                x = 0
                while time.monotonic() < end:
                    x += 1
            dist.barrier()
        if mode == "gil":
            dist.barrier()
            if rank == world - 1:
                ctypes.PyDLL(None).sleep(int(seconds))
            dist.barrier()
        while mode in ("loop", "large"):
            # the second element: ranks whose time is up; all stop on the same call
            buf = np.array([rank + 1.0, float(time.monotonic() >= end)])
            dist.all_reduce(buf)
            if buf[0] != expect:
                raise AssertionError(f"rank {rank}: all_reduce gave {buf[0]}, not {expect}")
            if mode == "large":
                big = np.full(1 << 16, rank + 1.0)
                dist.all_reduce(big)
                if not (big == expect).all():
                    raise AssertionError(f"rank {rank}: a large all_reduce gave {big[:4]}...")
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
