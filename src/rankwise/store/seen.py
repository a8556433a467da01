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
from datetime import timedelta
from typing import Any

from ..errors import DistError, DistTimeout

__all__ = ["count_seen_and_hold"]

#: longest a host holds its store for peers that have not counted in (they may be dead)
HOLD_LIMIT = 5.0
#: seconds between looks at the count while waiting for ``<key>/all``
_LOOK_AGAIN = 0.1


def count_seen_and_hold(store: Any, key: str, expected: Callable[[], int], hosting: bool,
                        limit: float = HOLD_LIMIT) -> None:
    """Add this process to the count at ``key``; when ``hosting``, wait (at most
    ``limit`` seconds) until it reaches ``expected()``. The process that completes the
    count sets ``<key>/all``, which wakes the host at once (a polling host returned up to
    a poll interval after its peers, and its first call's deadline lagged theirs); the
    count is looked at again between waits, since ``expected()`` may change. Never raises
    a store error: the failure being reported matters more than this courtesy."""
    done = f"{key}/all"
    try:
        if int(store.add(key, 1)) >= expected():
            store.set(done, "1")
        if hosting:
            end = time.monotonic() + limit
            while int(store.add(key, 0)) < expected():
                left = end - time.monotonic()
                if left <= 0:
                    return
                try:
                    store.wait([done], timedelta(seconds=min(_LOOK_AGAIN, left)))
                    return
                except DistTimeout:
                    continue
    except DistError:
        pass
