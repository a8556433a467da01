"""A plain FSDP2 (``fully_shard``) training script on the CPU with backend "gloo": no rankwise
import. Each rank checks that the parameters it gathers after a step are the same on every
rank (all of them started from one seed), so a wrong collective fails the run."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(gathered, full)
    assert all(torch.equal(g, full) for g in gathered), "ranks disagree on the parameters"
    print(f"fsdp2 rank {rank} of {world}: {len(full)} parameters agree", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
