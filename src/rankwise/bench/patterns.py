"""Call patterns of ``rankwise bench``: what a rank does around each timed call.

Why: back-to-back loops keep every rank in step, which flatters a spinning wait (issue 27).
Real programs compute between calls (ranks arrive apart) and call other libraries in
between.  Four patterns, chosen with ``--pattern``:

* ``lockstep``: calls back to back, the time of the whole batch (the historic number);
* ``skewed``: before each call a busy compute of a random 0..W us (``--skew W``) drawn from a
  per-rank seeded RNG, so ranks arrive apart; only the call itself is timed;
* ``interleaved``: each call is followed by a gloo all_reduce of the same size on a gloo
  group of the same ranks (a metric on another group, say); only the call itself is timed;
* ``stopflag``: each call is followed by a one-element gloo all_reduce (MAX) on a gloo group
  of the same ranks: a training loop's "should we stop" flag; only the call itself is timed.

Every library of a run sees the same pattern, and the same skew draws (the RNG restarts
for each timed batch), so their numbers pair.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PATTERNS", "SIDE_PATTERNS", "BatchTimes", "Pattern", "busy", "skew_draws",
           "timed_batch"]

PATTERNS = ("lockstep", "skewed", "interleaved", "stopflag")
#: the patterns whose every call is followed by a side call on a gloo group
SIDE_PATTERNS = ("interleaved", "stopflag")


@dataclass(frozen=True)
class Pattern:
    """The pattern's name and its one knob (``skew_us``: W of ``skewed``, else unused)."""

    name: str = "lockstep"
    skew_us: float = 0.0

    @property
    def has_side(self) -> bool:
        """Each call is followed by a side call on a gloo group (``SIDE_PATTERNS``)."""
        return self.name in SIDE_PATTERNS


@dataclass(frozen=True)
class BatchTimes:
    """One rank's timed batch: mean and median seconds per call."""

    mean: float
    median: float


def busy(seconds: float) -> None:
    """Burn the CPU for ``seconds`` (no sleep: a computing rank holds its core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def skew_draws(rank: int, iters: int, skew_us: float) -> list[float]:
    """The ``iters`` compute times (seconds, uniform in 0..skew_us us) this rank spends
    before its calls; seeded by the rank, so every library gets the same draws."""
    rng = random.Random(rank)  # noqa: S311 (a benchmark's skew, not a secret)
    return [rng.uniform(0.0, skew_us) * 1e-6 for _ in range(iters)]


def timed_batch(pattern: Pattern, rank: int, iters: int, call: Callable[[], None],
                side: Callable[[], None] | None = None) -> BatchTimes:
    """Run ``iters`` calls under ``pattern``; this rank's mean and median per call.

    ``side`` is the call after each timed one (``SIDE_PATTERNS`` need it).  ``lockstep``
    times the batch as a whole (no clock read per call), so its median is the mean."""
    if pattern.name not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern.name!r}; choose from {', '.join(PATTERNS)}")
    if pattern.name == "lockstep":
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        mean = (time.perf_counter() - t0) / iters
        return BatchTimes(mean, mean)
    if pattern.has_side and side is None:
        raise ValueError(f"the {pattern.name} pattern needs a side call (a gloo group)")
    waits = skew_draws(rank, iters, pattern.skew_us) if pattern.name == "skewed" else None
    clock = time.perf_counter
    took: list[float] = []
    for i in range(iters):
        if waits is not None:
            busy(waits[i])
        t0 = clock()
        call()
        took.append(clock() - t0)
        if side is not None and waits is None:
            side()
    return BatchTimes(sum(took) / iters, statistics.median(took))
