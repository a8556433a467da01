"""How long to spin and yield before sleeping, from the CPUs this process may use.

Why it matters: spinning is the fastest wait when every rank has a core of its own, and
the slowest when ranks outnumber cores (a spinning rank burns the time slice of the
peer it waits for: 4 ranks on 2 cores measured 4 ms per barrier with pure spinning,
31 us with spin-then-yield). So: spin only when the group fits the CPUs, then
``sched_yield`` for a bounded while, then futex sleeps.

Rounds of a large message can be waited for differently (``RANKWISE_SHM_LONG_YIELD_US``):
no spin, yield that long, then sleep on the futex. Why it exists: under outside load a
``sched_yield`` can hand the core to another program for the rest of its slice (30
yields per 64 MiB call at ~3 ms each, measured at load 7), while a futex sleeper is
woken by the publisher. Why it is off by default: in ``rankwise bench`` (4 ranks, 2
CPUs, load 5-6, same runs) sleeping at once cost 1 MiB 0.21-0.25x gloo against
0.12-0.14x yielding and pushed its kernel share to 18%; larger sizes were within noise.

Tunables (microseconds): ``RANKWISE_SHM_SPIN_US``, ``RANKWISE_SHM_YIELD_US``,
``RANKWISE_SHM_LONG_YIELD_US`` (above; unset: large rounds wait like any other).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["YIELD_ENV", "Policy", "policy_for", "usable_cpus"]

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
    #: for the rounds of a large message: no spin, yield this long, then sleep; None:
    #: wait for them as for any round
    long_yield_s: float | None


def _env_us(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ[name])) * 1e-6
    except (KeyError, ValueError):
        return default


def policy_for(nranks: int) -> Policy:
    oversubscribed = nranks > usable_cpus()
    spin = _env_us("RANKWISE_SHM_SPIN_US", 0.0 if oversubscribed else 50e-6)
    yld = _env_us(YIELD_ENV, 1e-3 if oversubscribed else 500e-6)
    long_yield = (_env_us("RANKWISE_SHM_LONG_YIELD_US", 0.0)
                  if "RANKWISE_SHM_LONG_YIELD_US" in os.environ else None)
    return Policy(spin, yld, 0.02, long_yield)
