# ruff: noqa: PLR0402, UP008 -- the tutorial's own spelling, kept verbatim
"""PyTorch's DDP tutorial script, unchanged but for the device: CPU and backend "gloo".

From "Getting Started with Distributed Data Parallel" (pytorch.org/tutorials/intermediate/
ddp_tutorial.html), section "Initialize DDP with torch.distributed.run/torchrun"
(elastic_ddp.py). Plain torch: no rankwise import.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    # create model (on the CPU: the tutorial moves it to GPU rank % device_count)
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    demo_basic()
