"""What diagnosis costs on the hot path: diagnosis on vs off, same processes, same run.

Diagnosis on the fast path is the call-site capture (a frame walk and a cached dict
lookup per call), the history record, and one clock read per wait; everything else
(who-is-where, divergence reports) only runs when something is already wrong. This
benchmark times 4-byte all_reduce and barrier with ``rankwise.diagnosis.set_enabled``
flipped between interleaved blocks inside the same rank processes, so machine noise hits
both alike, and prints the on/off latency ratio (target: overhead <= 5%).

    python benchmarks/diagnosis.py                  # 2 and 4 ranks
    python benchmarks/diagnosis.py --ranks 2 --iters 2000 --blocks 10
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


def _bench(rank: int, world: int, iters: int, blocks: int) -> dict[str, Any]:
    import numpy as np

    import rankwise as dist
    from rankwise.diagnosis import set_enabled

    t = np.ones(1, np.float32)  # 4 bytes
    ops = {"all_reduce": lambda: dist.all_reduce(t), "barrier": lambda: dist.barrier()}
    for fn in ops.values():  # warm up both paths (call-site cache, sockets)
        for on in (True, False):
            set_enabled(on)
            for _ in range(200):
                fn()
    times: dict[str, dict[bool, list[float]]] = {op: {True: [], False: []} for op in ops}
    for b in range(blocks):
        for name, fn in ops.items():
            for on in ((True, False) if b % 2 == 0 else (False, True)):
                set_enabled(on)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[name][on].append((time.perf_counter() - start) / iters)
    set_enabled(True)
    return {op: {str(on): v for on, v in d.items()} for op, d in times.items()}


def main() -> None:
    from rankwise.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'op':>10} {'off (us)':>9} {'on (us)':>9} {'on/off':>7} overhead"
          f" {'best off':>9} {'best on':>8} {'best on/off':>11}")
    for n in [int(x) for x in args.ranks.split(",")]:
        results = run_ranks(_bench, n, args=(args.iters, args.blocks), timeout=600)
        for res in results:
            if not res.ok:
                raise SystemExit(f"rank {res.rank} failed: {res.error_type}: {res.message}")
        for op in ("all_reduce", "barrier"):
            # per block: the slowest rank's mean (a collective is as fast as its slowest
            # rank); then the median over blocks
            # (median and best block: on a loaded machine the best is the steadier figure)
            def per_block(on: bool, op: str = op, results: Any = results) -> list[float]:
                blocks = zip(*(r.value[op][str(on)] for r in results))
                return [max(b) * 1e6 for b in blocks]

            off, on = per_block(False), per_block(True)
            ratio = statistics.median(on) / statistics.median(off)
            best = min(on) / min(off)
            print(f"{n:>5} {op:>10} {statistics.median(off):>9.1f} {statistics.median(on):>9.1f}"
                  f" {ratio:>7.3f} {(ratio - 1) * 100:+7.1f}% {min(off):>9.1f} {min(on):>8.1f}"
                  f" {best:>11.3f}")


if __name__ == "__main__":
    main()
