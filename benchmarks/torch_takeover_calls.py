"""Per call: what `rankwise run` adds to a plain torch script's collectives, in the same
processes. The default group, asked of "gloo", is taken over (backend "rankwise" over
torch's gloo, checks on); a second group of the same ranks is torch's plain gloo (made
with torch's own ``new_group``, which the takeover keeps as ``rankwise_takes_over``).
Each call the programs of ``torch_programs.py`` make is timed on both in interleaved
blocks (``_blocks``): per block the slowest rank, then the median over blocks.

    python benchmarks/torch_takeover_calls.py                 # 2 ranks, wall clock
    python benchmarks/torch_takeover_calls.py --clock cpu     # a loaded machine
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from _blocks import SRC, parse_args, slowest_per_block, time_blocks

CALLS = ("all_reduce", "async all_reduce+wait", "all_gather_single", "reduce_scatter_single",
         "broadcast_object_list", "barrier")
ELEMENTS = 256  #: float32 elements per rank: 1 KiB, a small model's bucket or shard


def _ops(dist: Any, group: Any, world: int) -> dict[str, Callable[[], object]]:
    import torch

    mine, out = torch.ones(ELEMENTS), torch.empty(ELEMENTS * world)
    full, part = torch.ones(ELEMENTS * world), torch.empty(ELEMENTS)
    ops: list[Callable[[], object]] = [
        lambda: dist.all_reduce(mine, group=group),
        lambda: dist.all_reduce(mine, group=group, async_op=True).wait(),  # DDP's buckets
        lambda: dist.all_gather_single(out, mine, group=group),  # FSDP2's all-gather
        lambda: dist.reduce_scatter_single(part, full, group=group),  # FSDP2's gradients
        lambda: dist.broadcast_object_list([1, "x"], src=0, group=group),  # checkpoint plans
        lambda: dist.barrier(group=group),
    ]
    return dict(zip(CALLS, ops, strict=True))


def rank_side(iters: int, blocks: int, clock: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() != "rankwise":
        raise SystemExit("the default group was not taken over: run under `rankwise run` "
                         "with rankwise installed (torch must see its entry point)")
    gloo = dist.new_group.rankwise_takes_over(backend="gloo")  # type: ignore[attr-defined]
    ops = {f"{name}/{side}": fn for side, group in (("rankwise", dist.group.WORLD),
                                                    ("gloo", gloo))
           for name, fn in _ops(dist, group, world).items()}
    times = time_blocks(ops, iters, blocks, lambda: dist.barrier(group=gloo), warmup=50,
                        clock=clock)
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, times, group=gloo)
    if rank == 0:
        print(f"{world} ranks, {clock} clock, {ELEMENTS * 4} B per rank: us per call "
              f"(median over {blocks} blocks of {iters}, slowest rank)")
        print(f"{'call':<22} {'rankwise':>9} {'gloo':>8} {'added':>8} {'ratio':>6}")
        for name in CALLS:
            ours, theirs = (statistics.median(slowest_per_block(per_rank, f"{name}/{side}"))
                            for side in ("rankwise", "gloo"))
            print(f"{name:<22} {ours:>9.1f} {theirs:>8.1f} {ours - theirs:>8.1f} "
                  f"{ours / theirs:>6.2f}", flush=True)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args(__doc__, ranks="2")
    if os.environ.get("RANKWISE_LAUNCHED") == "1":  # a rank, under `rankwise run`
        rank_side(args.iters, args.blocks, args.clock)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("RANKWISE_TORCH_CHECKS", None)  # `rankwise run`'s default: cpu
    for n in [int(x) for x in args.ranks.split(",")]:
        cmd = [sys.executable, "-m", "rankwise", "run", "--no-live", "-n", str(n), __file__,
               "--iters", str(args.iters), "--blocks", str(args.blocks), "--clock", args.clock]
        subprocess.run(cmd, env=env, check=True, timeout=900)


if __name__ == "__main__":
    main()
