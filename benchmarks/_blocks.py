"""Interleaved block timing shared by the same-run benchmarks.

Why blocks: these machines are shared and noisy. Timing each variant in blocks that
alternate which goes first makes a noise burst hit both alike; per block the slowest rank
counts (a collective is as fast as its slowest rank), then the median (and the best block,
the steadier figure on a loaded machine) over blocks.

``--clock cpu`` times the calling thread's CPU time instead of the wall clock: on a
machine whose load is several times its cores, wall time is mostly time spent waiting
for a core, while CPU time still shows what each call costs to run (waits for a peer
that block do not count; a spinning wait does).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)


def parse_args(doc: str, ranks: str = "2") -> argparse.Namespace:
    """``--ranks 2,4 --iters N --blocks N``: the options every same-run benchmark takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--ranks", default=ranks)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: time.perf_counter; cpu: the calling thread's CPU time")
    return parser.parse_args()


#: what ``--clock`` names: seconds from a wall clock or from the thread's CPU clock
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_blocks(ops: dict[str, Callable[[], object]], iters: int, blocks: int,
                sync: Callable[[], object], before: Callable[[str], object] | None = None,
                warmup: int = 0, clock: str = "wall") -> dict[str, list[float]]:
    """Seconds per call of each op, one figure per block, after ``warmup`` untimed calls
    of each (call-site caches, sockets, first-sight checks); ``sync`` (a barrier) lines the
    ranks up before each block, ``before(name)`` sets up a variant (a switch to flip);
    ``clock``: a name in ``CLOCKS``."""
    now = CLOCKS[clock]
    for name, fn in ops.items():
        if before is not None:
            before(name)
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for b in range(blocks):
        for name in (list(ops) if b % 2 == 0 else list(reversed(ops))):
            if before is not None:
                before(name)
            sync()
            fn = ops[name]
            start = now()
            for _ in range(iters):
                fn()
            times[name].append((now() - start) / iters)
    return times


def exchange(dist: Any, rank: int, peer: int, out: Any, back: Any) -> None:
    """One round trip between ranks 0 and 1: rank 0 sends ``out`` and receives ``back``,
    its peer receives ``out`` and sends ``back`` (a ping-pong when both are small, a
    one-way transfer plus an ack when ``out`` is large)."""
    if rank == 0:
        dist.send(out, peer)
        dist.recv(back, peer)
    else:
        dist.recv(out, peer)
        dist.send(back, peer)


def run_blocks(bench: Callable[..., dict[str, list[float]]], ranks: int,
               args: Sequence[Any], **init_kwargs: Any) -> list[dict[str, list[float]]]:
    """Run ``bench(rank, world, *args)`` on ``ranks`` processes; each rank's timings."""
    from rankwise.testing import run_ranks

    results = run_ranks(bench, ranks, args=tuple(args), timeout=600,
                        **({"init_kwargs": init_kwargs} if init_kwargs else {}))
    for res in results:
        if not res.ok:
            raise SystemExit(f"rank {res.rank} failed: {res.error_type}: {res.message}")
    return [res.value for res in results]


def slowest_per_block(per_rank: list[dict[str, list[float]]], name: str) -> list[float]:
    """Microseconds per call of ``name`` in each block, as the slowest rank saw it."""
    return [max(b) * 1e6 for b in zip(*(r[name] for r in per_rank))]
