"""What the torch backend costs: ``torch.distributed.all_reduce`` on backend "rankwise" vs
``rankwise.all_reduce``, same processes, same run, same rankwise group underneath.

The difference is torch's own Python wrapper (argument checks, the C++ dispatcher, the
trampoline back into Python) plus the backend's translation and its completed ``Work``.
Blocks of each are interleaved (alternating which goes first) so machine noise hits both
alike; per block the slowest rank counts (a collective is as fast as its slowest rank),
then the median over blocks. Target: torch/rankwise <= 1.20 on a 4-byte all_reduce.

    python benchmarks/torch_backend.py                  # 2 ranks
    python benchmarks/torch_backend.py --ranks 2,4 --iters 2000 --blocks 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))


def _bench(rank: int, world: int, iters: int, blocks: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as tdist

    import rankwise
    import rankwise.torch  # registers the "rankwise" torch backend
    from rankwise._world import current
    from rankwise.store.torch_views import TorchStoreView

    # rankwise is initialized by run_ranks; torch's default group then wraps its world
    tdist.init_process_group("rankwise", store=TorchStoreView(current().store), rank=rank,
                             world_size=world)
    t = torch.ones(1)  # 4 bytes
    ops = {"rankwise": lambda: rankwise.all_reduce(t), "torch": lambda: tdist.all_reduce(t)}
    for fn in ops.values():  # warm up both paths (call-site caches, sockets)
        for _ in range(300):
            fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for b in range(blocks):
        order = list(ops) if b % 2 == 0 else list(reversed(ops))
        for name in order:
            rankwise.barrier()
            start = time.perf_counter()
            fn = ops[name]
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - start) / iters)
    tdist.destroy_process_group()  # leaves rankwise's world to run_ranks (not torch's)
    return times


def main() -> None:
    from rankwise.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'rankwise (us)':>13} {'torch (us)':>10} {'torch/rankwise':>14} "
          f"{'best rw':>8} {'best torch':>10} {'best ratio':>10}")
    for n in [int(x) for x in args.ranks.split(",")]:
        results = run_ranks(_bench, n, args=(args.iters, args.blocks), timeout=600)
        for res in results:
            if not res.ok:
                raise SystemExit(f"rank {res.rank} failed: {res.error_type}: {res.message}")

        def per_block(name: str, results: Any = results) -> list[float]:
            return [max(b) * 1e6 for b in zip(*(r.value[name] for r in results))]

        rw, tw = per_block("rankwise"), per_block("torch")
        print(f"{n:>5} {statistics.median(rw):>13.1f} {statistics.median(tw):>10.1f} "
              f"{statistics.median(tw) / statistics.median(rw):>14.3f} {min(rw):>8.1f} "
              f"{min(tw):>10.1f} {min(tw) / min(rw):>10.3f}")


if __name__ == "__main__":
    main()
