"""A plain torch script (no rankwise import) for the launcher's tests, with torch's ``@record``.

    torch_plain_job.py fail RANK ATTEMPTS   rank RANK raises ValueError in the first ATTEMPTS
                                            attempts (TORCHELASTIC_RESTART_COUNT), after one
                                            all_reduce; then every rank completes
    torch_plain_job.py loop SECONDS         all_reduce in a loop for SECONDS, "ready" first
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def step(rank: int) -> float:
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    return float(x[0])


@record
def main() -> None:
    mode, arg = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    assert step(rank) == expected
    if mode == "fail":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if rank == int(arg[0]) and attempt < int(arg[1]):
            raise ValueError(f"bad batch on rank {rank} in attempt {attempt}")
        assert step(rank) == expected
    else:
        print(f"ready {rank} {os.getpid()} {socket.gethostname()}", flush=True)
        end = time.monotonic() + float(arg[0])
        while time.monotonic() < end:
            assert step(rank) == expected
            time.sleep(0.05)
    print(f"done {rank} of {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
