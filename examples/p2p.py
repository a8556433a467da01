"""Seed 003, part 1: point-to-point send/recv, synchronous and asynchronous.

The seed's program with two changes: ``import rankwise as dist`` and the "tcp" backend.
Rank 0 sends a tensor holding 1 to every other rank; each prints what it has.

    python examples/p2p.py            # 2 ranks, like the seed
    python examples/p2p.py 4          # 4 ranks
    rankwise run -n 4 examples/p2p.py # under the launcher (env:// init)
"""

import os
import sys

import torch
import torch.multiprocessing as mp

import rankwise as dist


def test_send_recv_sync(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        for dst in range(1, size):
            dist.send(tensor=tensor, dst=dst)  # dst: the rank to send to
    else:
        dist.recv(tensor=tensor, src=0)  # src: the rank to receive from
    print(f"Rank  {rank}  has data  {tensor[0]}", flush=True)  # every rank: 1.


def test_send_recv_async(rank, size):
    tensor = torch.zeros(1)
    reqs = []
    if rank == 0:
        tensor += 1
        reqs = [dist.isend(tensor=tensor, dst=dst) for dst in range(1, size)]
    else:
        reqs = [dist.irecv(tensor=tensor, src=0)]
    for req in reqs:
        req.wait()
    print(f"Rank  {rank}  has data  {tensor[0]}", flush=True)  # every rank: 1.


def run(rank, size):
    test_send_recv_sync(rank, size)
    dist.barrier()
    test_send_recv_async(rank, size)


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
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
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
