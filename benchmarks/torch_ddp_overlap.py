"""torch's own DDP on backend "rankwise" vs "gloo": step time, same model, data, processes.

    PYTHONPATH=src python benchmarks/torch_ddp_overlap.py [--worlds 2 4] [--rounds 5]

Each rank's default group is "rankwise" and a second group over the same ranks is gloo;
``torch.nn.parallel.DistributedDataParallel`` wraps two copies of one MLP, one per group,
with ``bucket_cap_mb`` set so the gradients make 2 buckets. Blocks of steps alternate
between the two (A B A B ...) so both see the same machine load. Reported: rank 0's median
step time per backend over all blocks, the spread (min-max of the block medians), the
ratio rankwise/gloo, and ``local`` (the same step without DDP): what overlap can hide.
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _block(step: Any, steps: int, pg: Any) -> float:
    """The median seconds of ``steps`` steps (ranks aligned by a barrier first)."""
    tdist.barrier(group=pg)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace,
            out: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rankwise.torch  # noqa: F401 - registers "rankwise"

    torch.set_num_threads(opts.threads)
    tdist.init_process_group("rankwise", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    groups = {"rankwise": tdist.group.WORLD, "gloo": tdist.new_group(backend="gloo")}
    base = _model(opts.width, opts.depth)
    bucket_mb = sum(p.numel() * 4 for p in base.parameters()) / 2**20 / 2 + 0.01
    x = torch.randn(opts.batch, opts.width)

    def step_of(model: nn.Module) -> Any:
        sgd = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step() -> None:
            model(x).square().mean().backward()
            sgd.step()
            sgd.zero_grad()
        return step

    steps = {"local": step_of(copy.deepcopy(base))}
    for name, pg in groups.items():
        ddp = DDP(copy.deepcopy(base), process_group=pg, bucket_cap_mb=bucket_mb)
        steps[name] = step_of(ddp)
        assert ddp.reducer is not None
    for s in steps.values():
        s()  # warm up: allocations, first buckets
    got: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(opts.rounds):
        for name, s in steps.items():
            got[name].append(_block(s, opts.steps, groups["gloo"]))
    if rank == 0:
        out.put(got)
    tdist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="per block")
    parser.add_argument("--rounds", type=int, default=5, help="alternated blocks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    opts = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}; MLP {opts.depth}x{opts.width}, batch {opts.batch}, "
          f"2 buckets; medians of {opts.rounds} alternated blocks of {opts.steps} steps")
    print(f"{'world':>5} {'backend':>9} {'step ms':>8} {'spread ms':>13} {'vs gloo':>8}")
    for world in opts.worlds:
        out = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, opts, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = out.get()
        for p in procs:
            p.join(120)
        gloo = statistics.median(got["gloo"])
        for name in ("local", "gloo", "rankwise"):
            blocks = got[name]
            med = statistics.median(blocks)
            print(f"{world:>5} {name:>9} {med * 1e3:>8.2f} "
                  f"{min(blocks) * 1e3:>6.2f}-{max(blocks) * 1e3:<6.2f} {med / gloo:>8.2f}")


if __name__ == "__main__":
    main()
