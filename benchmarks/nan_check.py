"""What the NaN check (``RANKWISE_NAN_CHECK``) costs a CPU DDP step, on vs off in the
same processes, in alternating blocks.

    PYTHONPATH=src python benchmarks/nan_check.py [--world 2] [--rounds 6]

rankwise's DDP on ``benchmarks/ddp.py``'s model (6x512 MLP, batch 32 per rank); each
round times a block of steps with the check off, then a block with it on
(``nan_check.set_on`` on every rank at the same step). Rank 0 prints the median step
per mode and the per-round on/off ratios (median, min..max).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp import free_port, make_model, timed_steps, trainer

import rankwise
from rankwise.checks import nan_check
from rankwise.nn import DistributedDataParallel


def worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    faulthandler.dump_traceback_later(opts.watchdog, exit=True)  # never hang silently
    torch.set_num_threads(1)
    rankwise.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(opts.batch, opts.width, generator=g)
    y = torch.randint(0, 10, (opts.batch,), generator=g)
    step = trainer(DistributedDataParallel(make_model(opts.width, opts.depth)), x, y)
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    for _ in range(opts.rounds):
        block = {}
        for on in (False, True):
            nan_check.set_on(on)
            t = timed_steps(step, opts.steps, rankwise.barrier)
            times[on] += t
            block[on] = statistics.median(t)
        ratios.append(block[True] / block[False])
    nan_check.set_on(False)
    if rank == 0:
        off, on_ = statistics.median(times[False]), statistics.median(times[True])
        print(f"world {world}: DDP step off {off * 1e3:.2f} ms, on {on_ * 1e3:.2f} ms; "
              f"on/off per round median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {opts.rounds} rounds of "
              f"{opts.steps} steps)", flush=True)
    rankwise.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=10, help="per block")
    parser.add_argument("--rounds", type=int, default=6, help="alternating on/off blocks")
    parser.add_argument("--watchdog", type=float, default=240, help="seconds before a dump")
    opts = parser.parse_args()
    rankwise.spawn(worker, args=(opts.world, free_port(), opts), nprocs=opts.world)


if __name__ == "__main__":
    main()
