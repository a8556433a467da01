"""rankwise DDP vs torch DDP (gloo) on the same model, data and processes.

    PYTHONPATH=src python benchmarks/ddp.py [--worlds 2 4] [--steps 20]

Each rank joins two process groups, rankwise's and torch.distributed's (gloo), and
alternates blocks of training steps between ``rankwise.nn.DistributedDataParallel`` and
``torch.nn.parallel.DistributedDataParallel`` so both see the same machine load. Per
framework it measures (medians of rank 0's per-step times):

- ``local``: forward + backward + SGD step with no communication at all;
- ``ddp``:   the same step under DDP;
- ``comm``:  the gradient all_reduces alone (same bucket layout, issued back to back).

The communication hidden behind backward is ``1 - (ddp - local) / comm`` (clipped to
[0, 1]): 100 % means DDP cost nothing over local training, 0 % that the all_reduces were
fully serialised after backward.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

import rankwise
from rankwise.nn import DistributedDataParallel
from rankwise.nn._comm import use_comm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def timed_steps(step: Callable[[], None], steps: int, barrier: Callable[[], Any]) -> list[float]:
    step()  # warm-up
    barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def trainer(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def comm_only(dist: Any, buffers: list[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for work in [dist.all_reduce(b, async_op=True) for b in buffers]:
            work.wait()

    return step


def worker(rank: int, world: int, ports: tuple[int, int], opts: argparse.Namespace) -> None:
    faulthandler.dump_traceback_later(opts.watchdog, exit=True)  # never hang silently
    torch.set_num_threads(1)
    rankwise.init_process_group(
        "tcp", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
    )
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    base = make_model(opts.width, opts.depth)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(opts.batch, opts.width, generator=g)
    y = torch.randint(0, 10, (opts.batch,), generator=g)

    use_comm(None)
    ours = DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    buffers = [b.buffer.clone() for b in ours.reducer.buckets]
    runs: dict[str, Callable[[], None]] = {
        "rankwise local": trainer(copy.deepcopy(base), x, y),
        "rankwise ddp": trainer(ours, x, y),
        "rankwise comm": comm_only(rankwise, buffers),
        "torch local": trainer(copy.deepcopy(base), x, y),
        "torch ddp": trainer(theirs, x, y),
        "torch comm": comm_only(tdist, buffers),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(opts.rounds):  # interleave so both frameworks see the same load
        for name, step in runs.items():
            barrier = rankwise.barrier if name.startswith("rankwise") else tdist.barrier
            times[name] += timed_steps(step, opts.steps, barrier)
    if rank == 0:
        report(world, {name: statistics.median(t) for name, t in times.items()}, ours, base)
    # torch's DDP keeps the gloo group alive; left to interpreter exit, gloo's threads
    # tear down mid-finalization and abort the process ("terminate called without an
    # active exception", 1 run in 6). Drop it while the peers are still all here.
    del runs, theirs
    gc.collect()
    tdist.barrier()
    tdist.destroy_process_group()
    rankwise.destroy_process_group()


def hidden_share(t: dict[str, float], who: str) -> float:
    exposed = t[f"{who} ddp"] - t[f"{who} local"]
    return min(1.0, max(0.0, 1.0 - exposed / t[f"{who} comm"]))


def report(world: int, t: dict[str, float], ours: DistributedDataParallel, base: nn.Module) -> None:
    params = sum(p.numel() for p in base.parameters())
    stats = ours.statistics()
    print(
        f"\n== {world} ranks: {params / 1e6:.2f} M params, {stats.buckets} buckets "
        f"({', '.join(f'{b / 2**20:.1f}' for b in stats.bucket_bytes)} MiB) =="
    )
    print(f"{'':10}{'local ms':>10}{'ddp ms':>10}{'comm ms':>10}{'hidden':>9}")
    for who in ("rankwise", "torch"):
        print(
            f"{who:10}{t[who + ' local'] * 1e3:10.1f}{t[who + ' ddp'] * 1e3:10.1f}"
            f"{t[who + ' comm'] * 1e3:10.1f}{hidden_share(t, who):9.0%}"
        )
    ratio = t["rankwise ddp"] / t["torch ddp"]
    print(f"step time ratio rankwise/torch: {ratio:.2f} ({'<=' if ratio <= 1 else '>'} 1)")
    mean_wait = stats.total_exposed_wait_s / max(stats.iterations, 1)
    print(f"rankwise: mean wait for communication after backward {mean_wait * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=10, help="per block")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved blocks")
    parser.add_argument("--watchdog", type=float, default=240, help="seconds before a dump")
    opts = parser.parse_args()
    for world in opts.worlds:
        rankwise.spawn(worker, args=(world, (free_port(), free_port()), opts), nprocs=world)


if __name__ == "__main__":
    main()
