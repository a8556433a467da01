"""Plain torch programs (backend "gloo", no rankwise import) whose final parameters the
tests compare bit for bit between `torchrun` and `rankwise run` with the checks on.

    torch_same_bits.py OUT WORKLOAD...   writes OUT/rank<R>.json: {"backend": the default
                                         group's backend, WORKLOAD: its final parameters}

``ddp_tutorial`` is PyTorch's DDP tutorial (its ToyModel, DDP, MSE loss, SGD) with seeded
inputs and a few steps; the others are the torch-stack workloads of
``_torch_client_workloads`` (FSDP2, tensor parallel, distributed checkpoint, pipelining) on
the default group.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the workloads
import _torch_client_workloads as workloads


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def ddp_tutorial(pg, rank, world, tmp):
    torch.manual_seed(0)
    model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.001)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(model(torch.randn(20, 10, generator=g)), torch.randn(20, 5, generator=g)).backward()
        optimizer.step()
    return {k: v.reshape(-1).tolist() for k, v in model.module.state_dict().items()}


WORKLOADS = {"ddp_tutorial": ddp_tutorial, "fsdp2": workloads.fsdp2,
             "tensor_parallel": workloads.tensor_parallel, "checkpoint": workloads.checkpoint,
             "pipelining": workloads._pipeline("ScheduleGPipe")}


def main():
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    got = {"backend": str(dist.get_backend())}
    for name in names:
        got[name] = WORKLOADS[name](dist.group.WORLD, rank, world, out / name)
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
