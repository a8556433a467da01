"""What rankwise's checks cost on the torch-gloo engine: a 4-byte all_reduce through
``rankwise.all_reduce`` on torch-gloo groups (``RANKWISE_CHECK`` = async, sync, off) vs
torch's gloo alone, in the same processes and the same run.

"torch gloo alone" is measured twice: ``torch.distributed.all_reduce`` on a torch gloo
default group made from the same rendezvous (what a torch user calls), and the engine's
own ``ProcessGroupGloo.allreduce(...).wait()`` (no Python wrapper at all: the floor).
Blocks of each are interleaved (alternating the order) so machine noise hits all
alike; per block the slowest rank counts (a collective is as fast as its slowest rank),
then the median over blocks. Targets (issue 13): async / torch <= 1.05; sync costs at
most one control round trip more than async (the round trip is measured too: a 1-byte
ping-pong on rankwise's control connection, ``rankwise.send``/``recv``; alone, and right
before a gloo op, where it costs more -- sync's own round trip sits there).

    python benchmarks/torch_engine.py --iters 200 --blocks 60   # 2 ranks
    python benchmarks/torch_engine.py --ranks 2,4 --iters 2000 --blocks 10
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from _blocks import exchange, parse_args, run_blocks, slowest_per_block, time_blocks

CHECKS = ("async", "sync", "off")


def _bench(rank: int, world: int, iters: int, blocks: int) -> dict[str, list[float]]:
    import numpy as np
    import torch
    import torch.distributed as tdist

    import rankwise
    from rankwise.api.world import current
    from rankwise.store import PrefixStore
    from rankwise.store.torch_views import TorchStoreView

    torch.set_num_threads(1)
    groups = {}
    for mode in CHECKS:  # the check mode is read when a torch-gloo group is made
        os.environ["RANKWISE_CHECK"] = mode
        groups[mode] = rankwise.new_group(backend="torch-gloo")
    view = TorchStoreView(PrefixStore("bench/torch-gloo/", current().store))
    tdist.init_process_group("gloo", store=view, rank=rank, world_size=world)
    t = torch.ones(1)  # 4 bytes
    raw = groups["off"].engine.pg
    one = np.zeros(1, np.uint8)
    peer = 1 - rank if rank < 2 else None

    def ping() -> None:  # one control round trip between ranks 0 and 1
        if peer is not None:
            exchange(rankwise, rank, peer, one, one)

    ops: dict[str, Callable[[], Any]] = {
        f"rankwise {m}": (lambda g=g: rankwise.all_reduce(t, group=g))
        for m, g in groups.items()}
    ops["torch all_reduce"] = lambda: tdist.all_reduce(t)
    ops["torch pg.allreduce"] = lambda: raw.allreduce([t]).wait()
    ops["control round trip"] = ping

    def ping_then_op() -> None:  # what a round trip costs where sync's happens
        ping()
        raw.allreduce([t]).wait()
    ops["round trip + pg.allreduce"] = ping_then_op
    times = time_blocks(ops, iters, blocks, rankwise.barrier, warmup=300)
    tdist.destroy_process_group()
    return times


def main() -> None:
    args = parse_args(__doc__, ranks="2")
    for n in [int(x) for x in args.ranks.split(",")]:
        per_rank = run_blocks(_bench, n, (args.iters, args.blocks), backend="tcp")
        blocks = {name: slowest_per_block(per_rank, name) for name in per_rank[0]}
        med = {name: statistics.median(b) for name, b in blocks.items()}
        best = {name: min(b) for name, b in blocks.items()}
        base, base_best = med["torch all_reduce"], best["torch all_reduce"]
        # each block's op against the torch block of the same round (seconds apart):
        # the machine's drift over the run, which moves whole blocks by 20%, cancels
        paired = {name: statistics.median(
            a / t for a, t in zip(b, blocks["torch all_reduce"], strict=True))
            for name, b in blocks.items()}
        print(f"{n} ranks, 4-byte all_reduce, median of {args.blocks} blocks x "
              f"{args.iters} calls (slowest rank per block; 'paired': the median of each "
              "block's ratio to the torch block of its round, the figure the targets "
              "are read from)")
        for name, us in med.items():
            print(f"  {name:<26} {us:8.1f} us   {us / base:6.3f}x torch all_reduce   "
                  f"paired {paired[name]:6.3f}x   best {best[name]:8.1f} us "
                  f"{best[name] / base_best:6.3f}x")
        extra = statistics.median(
            (s - a) / rt for s, a, rt in zip(blocks["rankwise sync"], blocks["rankwise async"],
                                             blocks["control round trip"], strict=True))
        # a round trip right before a gloo op costs more than one alone (the two
        # processes' I/O threads and gloo's share 2 cores): sync's is such a round trip
        placed = statistics.median(
            (s - a) / (pr - r) for s, a, pr, r in zip(
                blocks["rankwise sync"], blocks["rankwise async"],
                blocks["round trip + pg.allreduce"], blocks["torch pg.allreduce"],
                strict=True))
        print(f"  sync - async: {med['rankwise sync'] - med['rankwise async']:.1f} us; "
              f"paired per round: {extra:.2f} control round trips alone, {placed:.2f} "
              "round trips as one costs in front of a gloo op ((round trip + "
              "pg.allreduce) - pg.allreduce)")


if __name__ == "__main__":
    main()
