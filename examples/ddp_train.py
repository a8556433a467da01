"""Seed 001's experiment: train a small CNN with DDP and check the replicas stay identical.

    rankwise run -n 4 examples/ddp_train.py
    rankwise run -n 2 examples/ddp_train.py --engine torch-gloo   # torch's gloo moves the data
    rankwise run -n 2 examples/ddp_train.py --device cuda         # GPUs: NCCL for CUDA tensors

Every rank builds the same random image-classification dataset (3x32x32 images, labels
0-8, like the article's ``RandomClsDS`` but small enough for a CPU), reads its own shard
through ``DistributedSampler``, and trains its own copy of the model. DDP averages the
gradients during backward, so every rank applies the same update: every ``--check-every``
steps the ranks compare a hash of their parameters and rank 0 prints PASS or FAIL.
Without the launcher (no RANK in the environment) it runs as a group of one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rankwise
from rankwise.nn import DistributedDataParallel
from rankwise.utils.data import DistributedSampler


class RandomClsDS(Dataset[tuple[torch.Tensor, int]]):
    """Random images with random labels 0-8; item ``i`` is the same on every rank."""

    def __init__(self, size: int, image: int) -> None:
        self.size, self.image = size, image

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(item)
        label = int(torch.randint(0, 9, (), generator=g))
        return torch.randn(3, self.image, self.image, generator=g) + label / 4, label


def small_cnn(image: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (image // 4) ** 2, 9),
    )


def parameters_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


#: --engine: which engine moves the data (rankwise's checks stay on with every one)
BACKENDS = {"rankwise": "gloo", "torch-gloo": "torch-gloo"}


def backend_for(engine: str, device: str) -> str:
    """The backend string: CPU tensors on ``engine``; with ``--device cuda``, CUDA tensors
    on NCCL (rankwise's own engine) or on torch's gloo (``--engine torch-gloo``)."""
    if device == "cuda" and engine == "rankwise":
        if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
            return "cpu:gloo,cuda:nccl"
        # ranks would share a GPU, which NCCL refuses: gloo stages CUDA tensors through
        # host memory instead
        return "gloo"
    return BACKENDS[engine]


def replicas_identical(model: nn.Module, rank: int, world: int, step: int) -> bool:
    """All-gather the parameter hashes; rank 0 prints a PASS/FAIL line."""
    hashes: list[Any] = [None] * world
    rankwise.all_gather_object(hashes, parameters_hash(model))
    same = len(set(hashes)) == 1
    if rank == 0:
        detail = f"all {world} ranks hold {hashes[0]}" if same else f"hashes {hashes}"
        print(f"step {step:4d}  parameter check: {'PASS' if same else 'FAIL'} ({detail})")
    return same


class Progress:
    """A dependency-free progress bar: redrawn in place on a terminal, else every 25%."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stdout.isatty()
        self.next_quarter = 1

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        filled = 30 * done // self.total
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {text}"
        if self.tty:
            print("\r" + line, end="\n" if done == self.total else "", flush=True)
        elif done * 4 >= self.next_quarter * self.total:
            self.next_quarter = done * 4 // self.total + 1
            print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--check-every", type=int, default=4)
    parser.add_argument("--engine", choices=sorted(BACKENDS), default="rankwise",
                        help="what moves the data: rankwise's own engine or torch's gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank (LOCAL_RANK), ranks may share one")
    args = parser.parse_args()

    torch.set_num_threads(1)  # N ranks share the machine's cores
    backend = backend_for(args.engine, args.device)
    if "RANK" in os.environ:
        rankwise.init_process_group(backend, init_method="env://")
    else:
        print("no RANK in the environment: running as a group of one (use rankwise run -n 4)")
        rankwise.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0,
                                    world_size=1)
    rank, world = rankwise.get_rank(), rankwise.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if rank == 0:
        print(f"backend {backend!r} on {device}: data moved by "
              f"{rankwise.group.WORLD.engine_name()}")

    torch.manual_seed(rank)  # different initial weights on purpose: DDP broadcasts rank 0's
    model = DistributedDataParallel(small_cnn(args.image).to(device))
    dataset = RandomClsDS(args.samples, args.image)
    sampler = DistributedSampler(dataset, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ok = replicas_identical(model, rank, world, step=0)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        progress = Progress(len(loader), enabled=rank == 0)
        loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of losses, batches]
        start = time.perf_counter()
        for i, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(device), labels.to(device)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            progress.update(i, f"loss {loss.item():.3f}")
            if step % args.check_every == 0:
                ok &= replicas_identical(model, rank, world, step)
        elapsed = time.perf_counter() - start
        rankwise.all_reduce(loss_sum)
        if rank == 0:
            samples = len(loader) * args.batch * world
            print(
                f"epoch {epoch}: mean loss {loss_sum[0] / loss_sum[1]:.4f}  "
                f"{samples / elapsed:.0f} samples/s ({world} ranks, {elapsed:.1f}s)"
            )
    ok &= replicas_identical(model, rank, world, step)
    if rank == 0:
        print(f"RESULT: {'PASS' if ok else 'FAIL'}: parameters identical on all {world} ranks")
    rankwise.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
