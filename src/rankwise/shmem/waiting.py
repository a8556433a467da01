"""How long to spin and yield before sleeping, from the CPUs this process may use.

Why it matters: spinning is the fastest wait when every rank has a core of its own, and
the slowest when ranks outnumber cores (a spinning rank burns the time slice of the
peer it waits for: 4 ranks on 2 cores measured 4 ms per barrier with pure spinning,
31 us with spin-then-yield). So: spin only when the group fits the CPUs, then
``sched_yield`` for a bounded while, then futex sleeps.

Arrival skew: when an oversubscribed group's ranks have lately reached their calls far
apart (they compute between calls), a call's first wait is long whatever we do, and
yielding through it takes the CPU a peer still computing needs; such waits go to the
futex after the short spin (``Arrivals``). With a CPU per rank the rule is off by
default: there it measured no better than yielding (docs/waiting.md).

Tunables (microseconds): ``RANKWISE_SHM_SPIN_US``, ``RANKWISE_SHM_YIELD_US``,
``RANKWISE_SHM_SKEW_US`` (a huge value turns the skew rule off). (Sleeping
at once in a large message's rounds, instead of yielding first, was tried: at 4 ranks on
2 CPUs it cost 1 MiB 0.21-0.25x gloo against 0.12-0.14x and an 18% kernel share, and
larger sizes were within noise.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .. import settings

__all__ = ["YIELD_ENV", "Arrivals", "Policy", "policy_for", "usable_cpus"]

YIELD_ENV = "RANKWISE_SHM_YIELD_US"


def usable_cpus() -> int:
    """CPUs in our affinity mask, capped by a cgroup v2 CPU quota when one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@dataclass(frozen=True, slots=True)
class Policy:
    spin_s: float   #: poll without giving up the CPU this long
    yield_s: float  #: then poll with sched_yield this long, then futex sleeps
    sleep_s: float  #: longest single futex sleep (bounds a missed wake-up, too)
    #: a call's first wait skips the yield stage while recent first waits averaged more
    skew_s: float = math.inf


def _env_us(name: str, default: float) -> float:
    value = settings.number(name, math.nan)
    return default if math.isnan(value) else value * 1e-6


def policy_for(nranks: int) -> Policy:
    oversubscribed = nranks > usable_cpus()
    spin = _env_us("RANKWISE_SHM_SPIN_US", 0.0 if oversubscribed else 50e-6)
    # a CPU per rank: yielding costs no peer anything, and ends a wait ~40 us sooner than
    # a futex wake-up (docs/waiting.md, "The yield budget")
    yld = _env_us(YIELD_ENV, 1e-3 if oversubscribed else 2e-3)
    skew = _env_us("RANKWISE_SHM_SKEW_US", 0.25 * yld if oversubscribed else math.inf)
    return Policy(spin, yld, 0.02, skew)


class Arrivals:
    """Whether a group's ranks have lately arrived apart: a moving average of how long
    this rank's first wait of each call lasted (0 when every peer was already there).

    Each sample is capped at ``4 * limit_s`` so that one wait stretched by a descheduled
    peer (milliseconds under load) cannot hold the rule on for long; with weight 1/8 a
    run of short waits turns it off again within about a dozen calls."""

    __slots__ = ("limit", "mean")

    WEIGHT = 0.125

    def __init__(self, limit_s: float) -> None:
        self.limit = limit_s
        self.mean = 0.0

    def saw(self, waited_s: float) -> None:
        """Record one first wait (seconds)."""
        self.mean += (min(waited_s, 4.0 * self.limit) - self.mean) * self.WEIGHT

    @property
    def skewed(self) -> bool:
        """True while recent first waits averaged more than the limit."""
        return self.mean > self.limit
