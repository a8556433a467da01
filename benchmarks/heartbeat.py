"""Heartbeats: cost in a 4-byte all_reduce loop (same-run A/B) and CPU while idle.

Runs ``rankwise run -n N`` jobs alternately with heartbeats on (default timeout) and off
(``RANKWISE_HEARTBEAT_TIMEOUT=0``), ``--rounds`` times each, and prints the per-call time of
each job and the on/off ratio (median, min-max). ``--idle`` instead measures the CPU time a
rank spends while idle for ``--idle`` seconds after init, with heartbeats on and off.

    python benchmarks/heartbeat.py --ranks 4 --iters 3000 --rounds 5
    python benchmarks/heartbeat.py --ranks 4 --idle 10
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def _rank(iters: int, idle: float) -> None:
    import numpy as np

    import rankwise as dist

    dist.init_process_group("tcp")
    buf = np.ones(1, dtype=np.float32)
    for _ in range(200):
        dist.all_reduce(buf)
    if idle:
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(idle)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(f"RESULT {cpu / idle * 100:.4f}", flush=True)  # % of one core
    else:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        print(f"RESULT {(time.perf_counter() - start) / iters * 1e6:.3f}", flush=True)  # us/call
    dist.destroy_process_group()


def _job(ranks: int, iters: int, idle: float, on: bool) -> float:
    env = dict(os.environ)
    env["RANKWISE_HEARTBEAT_TIMEOUT"] = "" if on else "0"
    out = subprocess.run([sys.executable, "-m", "rankwise", "run", "-n", str(ranks), __file__,
                          "--rank", str(iters), str(idle)], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    values = [float(line.split()[1]) for line in out.splitlines() if line.startswith("RESULT")]
    return max(values) if not idle else statistics.mean(values)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        _rank(int(sys.argv[2]), float(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle", type=float, default=0.0)
    a = p.parse_args()
    unit = "% of a core per rank, idle" if a.idle else "us per all_reduce (slowest rank)"
    ratios = []
    for r in range(a.rounds):
        on = _job(a.ranks, a.iters, a.idle, True)
        off = _job(a.ranks, a.iters, a.idle, False)
        ratios.append(on / off if off else float("nan"))
        print(f"round {r}: heartbeats on {on:.3f}, off {off:.3f} ({unit})", flush=True)
    if not a.idle:
        print(f"on/off: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {a.rounds} rounds")


if __name__ == "__main__":
    main()
