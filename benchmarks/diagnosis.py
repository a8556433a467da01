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

import statistics

from _blocks import parse_args, run_blocks, slowest_per_block, time_blocks


def _bench(rank: int, world: int, iters: int, blocks: int) -> dict[str, list[float]]:
    import numpy as np

    import rankwise as dist
    from rankwise.diagnosis import set_enabled

    t = np.ones(1, np.float32)  # 4 bytes
    ops = {"all_reduce": lambda: dist.all_reduce(t), "barrier": lambda: dist.barrier()}
    # each op twice: "all_reduce/on" and "all_reduce/off", the switch flipped before a block
    variants = {f"{name}/{state}": fn for name, fn in ops.items() for state in ("on", "off")}
    times = time_blocks(variants, iters, blocks, dist.barrier,
                        before=lambda v: set_enabled(v.endswith("/on")), warmup=200)
    set_enabled(True)
    return times


def main() -> None:
    args = parse_args(__doc__, ranks="2,4")
    print(f"{'ranks':>5} {'op':>10} {'off (us)':>9} {'on (us)':>9} {'on/off':>7} overhead"
          f" {'best off':>9} {'best on':>8} {'best on/off':>11}")
    for n in [int(x) for x in args.ranks.split(",")]:
        per_rank = run_blocks(_bench, n, (args.iters, args.blocks))
        for op in ("all_reduce", "barrier"):
            off, on = (slowest_per_block(per_rank, f"{op}/{s}") for s in ("off", "on"))
            ratio = statistics.median(on) / statistics.median(off)
            best = min(on) / min(off)
            print(f"{n:>5} {op:>10} {statistics.median(off):>9.1f} {statistics.median(on):>9.1f}"
                  f" {ratio:>7.3f} {(ratio - 1) * 100:+7.1f}% {min(off):>9.1f} {min(on):>8.1f}"
                  f" {best:>11.3f}")


if __name__ == "__main__":
    main()
