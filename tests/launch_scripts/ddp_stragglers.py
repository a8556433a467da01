"""A small DDP training loop for the straggler and NaN-origin tests (issue 48).

    rankwise run -n 4 ddp_stragglers.py --sleep-rank 2 --sleep-ms 30
    rankwise run -n 2 --nan-check ddp_stragglers.py --nan-rank 1 --nan-step 5

``--ddp rankwise`` (rankwise's DDP) or ``--ddp torch`` (torch's DDP on backend
"rankwise"). The dataset hands out whole batches, so ``--sleep-ms`` is a sleep per batch
in ``Dataset.__getitem__`` on ``--sleep-rank``. ``--nan-rank`` writes a NaN into
``fc1.weight``'s gradient at ``--nan-step``; every rank then prints ``RAISED ...`` and
whether its parameters are still those of the step before.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rankwise


class Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)  # the straggler's line
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


def wrap(model: nn.Module, which: str) -> nn.Module:
    if which == "torch":
        importlib.import_module("rankwise.torch")  # registers backend "rankwise"

        torch.distributed.init_process_group("rankwise")
        return torch.nn.parallel.DistributedDataParallel(model)
    from rankwise.nn import DistributedDataParallel

    rankwise.init_process_group("gloo")
    return DistributedDataParallel(model)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ddp", choices=["rankwise", "torch"], default="rankwise")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--sleep-rank", type=int, default=-1)
    p.add_argument("--sleep-ms", type=float, default=30.0)
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=5)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = wrap(Net(), args.ddp)
    sleep_s = args.sleep_ms / 1000 if rank == args.sleep_rank else 0.0
    loader = DataLoader(Batches(args.steps, sleep_s), batch_size=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"step": 0}
    inner: Any = model.module
    if rank == args.nan_rank:
        inner.fc1.weight.register_hook(
            lambda g: g * float("nan") if state["step"] == args.nan_step else g)
    if rank == 0:
        print("training starts", flush=True)
    before: list[torch.Tensor] = []
    for step, (x, y) in enumerate(loader, start=1):
        state["step"] = step
        before = [q.detach().clone() for q in model.parameters()]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        try:
            loss.backward()  # type: ignore[no-untyped-call]  # the backward line
        except Exception as exc:  # noqa: BLE001 - printed for the test to read
            same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            finite = all(bool(torch.isfinite(q.grad).all()) for q in model.parameters()
                         if q.grad is not None)
            text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            print(f"RAISED step={step} rank={rank} params_same={same} "
                  f"grads_finite={finite} {text}", flush=True)
            os._exit(0)  # the reducer is mid-backward: no clean teardown to test here
        opt.step()
    if rank == 0:
        print(f"finished {args.steps} steps", flush=True)
    rankwise.destroy_process_group() if args.ddp == "rankwise" else \
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
