"""The one exception of its own the shm engine adds.

``ShmUnavailable`` is raised at construction only, before any collective ran, on every
rank alike; the integrator turns it into a fallback to the TCP engine with one log line
(its message names the fix, e.g. ``docker run --shm-size=1g``). It subclasses
``DistError`` so that an unhandled one is still a rankwise error.
"""

from __future__ import annotations

from ...errors import CollectiveMismatch, DistError

__all__ = ["ShmCallMismatch", "ShmUnavailable"]

#: (op, dtype code, element count, reduce-op code, root, call-site id, call flags)
CallTuple = tuple[int, int, int, int, int, int, int]


class ShmUnavailable(DistError):
    """Shared memory cannot be used for this group here; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ShmCallMismatch(CollectiveMismatch):
    """Two ranks published different calls for one round; the fields let the engine
    word the error like every other mismatch (``peer`` is the peer's group rank)."""

    def __init__(self, message: str, *, peer: int, theirs: CallTuple, their_site: str,
                 mine: CallTuple, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail  #: what differs beyond the fingerprints (sizes per pair)
        self.peer = peer
        self.theirs = theirs
        self.their_site = their_site
        self.mine = mine
