"""Keep the store up until every process has read the failure it is about to report.

Why: a failure found in a store round (a rendezvous that disagrees, groups created out
of order) is found by every rank on its own, and each raises. The process hosting the
store then exits, and its store with it, while a slower peer may still be reading the
entries that would explain the failure: that peer reports "the store went away" instead
of the real error. So each rank counts itself in once it has read everything it needs,
and the host waits, bounded, until the count reaches everyone it expects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import DistError

__all__ = ["count_seen_and_hold"]

#: longest a host holds its store for peers that have not counted in (they may be dead)
HOLD_LIMIT = 5.0


def count_seen_and_hold(store: Any, key: str, expected: Callable[[], int], hosting: bool,
                        limit: float = HOLD_LIMIT) -> None:
    """Add this process to the count at ``key``; when ``hosting``, wait (at most
    ``limit`` seconds, polling the count) until it reaches ``expected()``. Never raises
    a store error: the failure being reported matters more than this courtesy."""
    try:
        store.add(key, 1)
        if hosting:
            end = time.monotonic() + limit
            while time.monotonic() < end and int(store.add(key, 0)) < expected():
                time.sleep(0.02)
    except DistError:
        pass
