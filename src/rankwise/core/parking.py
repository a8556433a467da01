"""The router's parking caps: what arrived before anyone asked for it is bounded per peer
and in total (``RANKWISE_PARKED_PER_PEER``, ``RANKWISE_PARKED_TOTAL``); a frame that
would pass a cap holds its peer's reading back until a receive takes parked data."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .mailbox import OVERHEAD, PARKED_PER_PEER, PARKED_TOTAL, Arrival, env_bytes

__all__ = ["Parking"]


class Parking:
    """Parking accounts of a ``Router`` (whose ``_lock`` guards them)."""

    _lock: threading.Lock

    def __init__(self, per_peer: int | None, total: int | None) -> None:
        self.per_peer_cap = per_peer or env_bytes("RANKWISE_PARKED_PER_PEER", PARKED_PER_PEER)
        self.total_cap = total or env_bytes("RANKWISE_PARKED_TOTAL", PARKED_TOTAL)
        self._parked: dict[int, int] = {}  #: bytes parked per source rank
        self._parked_total = 0
        #: peers whose transport stopped reading because a frame did not fit (see HOLD)
        self._held: set[int] = set()
        #: the transport's "read from this peer again" (set by whoever owns both)
        self.resume: Callable[[int], None] | None = None

    # --- parking caps (lock held unless said otherwise) ---------------------------------

    def _fits_locked(self, src: int, n: int) -> bool:
        cost = n + OVERHEAD
        return (self._parked.get(src, 0) + cost <= self.per_peer_cap
                and self._parked_total + cost <= self.total_cap)

    def _park_locked(self, arrival: Arrival) -> None:
        cost = arrival.frame.payload_len + OVERHEAD
        arrival.parked = cost
        src = arrival.frame.src
        self._parked[src] = self._parked.get(src, 0) + cost
        self._parked_total += cost

    def _unpark_locked(self, arrival: Arrival) -> None:
        cost = arrival.parked
        if cost:  # (clamped: a failure may have reset the counts meanwhile)
            arrival.parked = 0
            src = arrival.frame.src
            left = self._parked.get(src, 0) - cost
            if left > 0:
                self._parked[src] = left
            else:
                self._parked.pop(src, None)
            self._parked_total = max(0, self._parked_total - cost)

    def _take_held(self) -> list[int]:
        """Peers held back, to resume once the lock is released (lock held)."""
        if not self._held:
            return []
        held = list(self._held)
        self._held.clear()
        return held

    def _resume_all(self, held: list[int]) -> None:
        """Let the transport try the held peers' next frames again (lock not held)."""
        resume = self.resume
        if resume is not None:
            for rank in held:
                resume(rank)

    def parked(self) -> dict[str, object]:
        """Statistics: bytes parked per peer and in total, peers held back."""
        with self._lock:
            return {"per_peer": {r: b for r, b in self._parked.items() if b},
                    "total": self._parked_total, "held": sorted(self._held),
                    "per_peer_cap": self.per_peer_cap, "total_cap": self.total_cap}
