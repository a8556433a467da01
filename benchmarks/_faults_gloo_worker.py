"""The netns test worker's ``loop`` mode on torch.distributed + gloo (for benchmarks/faults.py)."""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    seconds = float(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        buf = torch.tensor([rank + 1.0, 0.0])
        dist.all_reduce(buf)
        print(f"ready {rank} {os.getpid()} {socket.gethostname()}", flush=True)
        end = time.monotonic() + seconds
        while True:
            buf = torch.tensor([rank + 1.0, float(time.monotonic() >= end)])
            dist.all_reduce(buf)
            if buf[1]:
                break
            time.sleep(0.01)
        print(f"done {rank}", flush=True)
    except Exception as exc:
        print(f"raised {rank} {time.monotonic():.3f} {type(exc).__name__}: {exc}", flush=True)
        raise
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
