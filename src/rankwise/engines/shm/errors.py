"""The shm engine's call-mismatch exception (``ShmUnavailable`` lives in ``shmem.errors``)."""

from __future__ import annotations

from ...errors import CollectiveMismatch
from ...shmem.errors import ShmUnavailable

__all__ = ["ShmCallMismatch", "ShmUnavailable"]

#: (op, dtype code, element count, reduce-op code, root, call-site id, call flags)
CallTuple = tuple[int, int, int, int, int, int, int]


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
