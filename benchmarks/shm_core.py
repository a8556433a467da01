"""Latency of the shared-memory collective core (``rankwise.engines.shm``), no API layer.

Usage: ``python benchmarks/shm_core.py [--ranks 2 4] [--slot BYTES]``. Spawns the ranks,
times each case as the median over repetitions of (max over ranks) per call, measured
after a barrier. Prints one line per case. Numbers are core-only: the public API adds
argument checks, fingerprinting and call-site capture on top.

Measured 2026-11-23, medians, ``taskset -c 0,1`` on a 16-core Xeon (device machine A,
quiet; slot 1 MiB; two-rounds-per-chunk all_reduce of commit 935c659):

    ranks  barrier   4 B all_reduce   1 MiB all_reduce   64 MiB all_reduce
    2      2.9 us    7.7 us           231 us             16.3 ms
    4      30 us     58 us            510 us             44 ms    (4 ranks on 2 CPUs)

Machine B (another, ~2x slower instance) for the one-round-per-chunk all_reduce (cf6fd29):
2 ranks 6-7 us / 14-16 us / 260-350 us / 21.6-23 ms; 4 ranks 39 us / 72 us / 640 us /
53 ms; same machine, back to back: 64 MiB 22.4 / 21.6 ms vs 24.1 / 24.4 ms for the
first version. On the shared 2-core dev box (load 4-10 from other jobs), A/B back to
back: 64 MiB 2 ranks 31 ms (two rounds per chunk) -> 15 ms (one).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

CASES = [("barrier", 0, 3000), ("all_reduce", 4, 3000), ("all_reduce", 1 << 20, 200),
         ("all_reduce", 64 << 20, 12)]


def _rank(rank: int, size: int, path: str, slot: int | None, q: Any) -> None:
    from rankwise.engines.shm import ShmGroup
    from rankwise.identity import callsite as _callsite
    from rankwise.identity.calls import Fingerprint
    from rankwise.store import FileStore
    from rankwise.wire import hugepages
    from rankwise.wire.buffers import _NUMPY_NATIVE, ReduceOp
    from rankwise.wire.frames import Op

    g = ShmGroup(FileStore(path, size, timeout=60), "bench", rank, size, timeout=60,
                 slot_bytes=slot)
    site = _callsite.capture()
    d = _NUMPY_NATIVE[np.dtype(np.float32)]
    fb = Fingerprint(int(Op.barrier), 0, 0, 0, -1, 0)
    fa = Fingerprint(int(Op.all_reduce), d.code, ReduceOp.SUM.code, 0, -1, -1)
    far = time.monotonic() + 3600
    out = []
    for name, nbytes, reps in CASES:
        a = np.ones(nbytes // 4, np.float32)
        if a.nbytes >= hugepages.MIN_BYTES:
            hugepages.advise(a)  # as rankwise's as_buffer does for large user tensors
        times = []
        # a few untimed calls warm caches and page in the slots
        for i in range(reps + 3):
            g.barrier(fb, site, far)
            t0 = time.perf_counter()
            if name == "barrier":
                g.barrier(fb, site, far)
            else:
                g.all_reduce(fa, site, a, d, ReduceOp.SUM, far)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out.append(times)
    q.put((rank, out, g.statistics()))
    g.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--slot", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="skip the 64 MiB case")
    args = ap.parse_args()
    if args.quick:
        CASES[:] = [c for c in CASES if c[1] < 64 << 20]
    ctx = mp.get_context("spawn")
    for size in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            q: Any = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, size, os.path.join(tmp, "s"),
                                                     args.slot, q)) for r in range(size)]
            for p in procs:
                p.start()
            got = [q.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(30)
        stats = got[0][2]
        print(f"{size} ranks (cpus {len(os.sched_getaffinity(0))}, slot {stats['slot_bytes']}, "
              f"spin {stats['spin_ns'] / 1e3:g} us, yield {stats['yield_ns'] / 1e3:g} us)")
        for k, (name, nbytes, _) in enumerate(CASES):
            per_call = [max(g[1][k][i] for g in got) for i in range(len(got[0][1][k]))]
            med = statistics.median(per_call)
            p90 = sorted(per_call)[int(0.9 * len(per_call))]
            label = name if not nbytes else f"{name} {nbytes} B"
            unit, scale = ("ms", 1e3) if med > 1e-3 else ("us", 1e6)
            print(f"  {label:24s} median {med * scale:8.1f} {unit}   p90 {p90 * scale:8.1f} {unit}")


if __name__ == "__main__":
    main()
