"""Seed 003, part 2: the six collectives, with the results the seed's comments promise.

The seed's program with two changes: ``import rankwise as dist`` and the "tcp" backend.

    python examples/collectives.py            # 4 ranks, like the seed
    python examples/collectives.py 2          # 2 ranks
    rankwise run -n 4 examples/collectives.py # under the launcher (env:// init)
"""

import os
import sys

import torch
import torch.multiprocessing as mp

import rankwise as dist


def test_broadcast(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 2
    else:
        tensor += 1
    dist.broadcast(tensor=tensor, src=0)  # src: the rank whose data everyone gets
    print(f"******test_broadcast******\nRank  {rank}  has data  {tensor}", flush=True)  # every rank: 2


def test_scatter(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor_list = [torch.tensor([float(i + 1)]) for i in range(size)]
        dist.scatter(tensor, scatter_list=tensor_list, src=0)
    else:
        dist.scatter(tensor, scatter_list=[], src=0)
    print(f"******test_scatter******\nRank  {rank}  has data  {tensor}", flush=True)  # rank i: i+1


def test_reduce(rank, size):
    tensor = torch.ones(1)
    dist.reduce(tensor=tensor, dst=0)  # dst: the rank that gets the sum (default op SUM)
    print(f"******test_reduce******\nRank  {rank}  has data  {tensor}", flush=True)  # rank 0: size


def test_all_reduce(rank, size):
    tensor = torch.ones(1)
    dist.all_reduce(tensor=tensor, op=dist.ReduceOp.SUM)
    print(f"******test_all_reduce******\nRank  {rank}  has data  {tensor}", flush=True)  # every rank: size


def test_gather(rank, size):
    tensor = torch.ones(1)
    if rank == 0:
        output = [torch.zeros(1) for _ in range(size)]
        dist.gather(tensor, gather_list=output, dst=0)
    else:
        dist.gather(tensor, gather_list=[], dst=0)
    if rank == 0:
        print(f"******test_gather******\nRank  {rank}  has data  {output}", flush=True)  # rank 0: [1, 1, ...]


def test_all_gather(rank, size):
    output = [torch.zeros(1) for _ in range(size)]
    tensor = torch.ones(1)
    dist.all_gather(output, tensor)
    print(f"******test_all_gather******\nRank  {rank}  has data  {output}", flush=True)  # every rank: [1, 1, ...]


def run(rank, size):
    test_reduce(rank, size)
    test_all_reduce(rank, size)
    test_gather(rank, size)
    test_all_gather(rank, size)
    test_broadcast(rank, size)
    test_scatter(rank, size)


def init_process(rank, size, port, backend="tcp"):
    """Initialize the distributed environment: master address and port."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=size)
    run(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by `rankwise run` / torchrun: env:// init
        dist.init_process_group("tcp")
        run(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
        sys.exit(0)
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    port = int(os.environ.get("MASTER_PORT", "0")) or __import__("rankwise.testing").testing.free_port()
    mp.set_start_method("spawn")
    processes = []
    for rank in range(size):
        p = mp.Process(target=init_process, args=(rank, size, port))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    sys.exit(max(abs(p.exitcode or 0) for p in processes))
