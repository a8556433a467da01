"""Seed 000's barrier trap as a plain torch script (backend "gloo", no rankwise import).

The common "rank 0 first" context manager, and a loader built inside it on every rank, then
once more on rank 0 alone (the validation loader): rank 0's releasing barrier pairs with
the others' end-of-epoch barrier, and the ranks go on out of step until rank 0's
end-of-epoch barrier meets the others' all_reduce. Under torch's gloo both wait out the
timeout; under `rankwise run` (checks on) both raise CollectiveMismatch at once.
"""

import datetime
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def torch_distributed_zero_first(rank):
    if rank not in [-1, 0]:
        dist.barrier()  # the other ranks wait here
    yield
    if rank == 0:
        dist.barrier()  # rank 0 releases them


def create_dataloader(rank):
    with torch_distributed_zero_first(rank):
        return torch.arange(8.0)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    train = create_dataloader(rank)
    dist.broadcast(train, 0)
    if rank in [-1, 0]:
        create_dataloader(rank)  # the validation loader, on rank 0 only: the trap
    dist.barrier()  # end of the epoch
    dist.all_reduce(train)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
