"""One ``Transport`` made of several: each peer is reached by the one that suits it.

Why: in a job spread over hosts, the ranks of one host should talk through shared memory
and the others through TCP; the layers above see one transport either way. Each part
keeps its own reader thread and delivers to the same handler (the router locks its own
state, so two readers are fine). A part reports the loss only of the peers it carries:
a peer's other part may close first, before its last frames arrived on the routed one.
Driving (``drive_begin``) is declined: a driver would read only one part while frames of
the other still need their own thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import DistNetworkError
from .base import FrameHandler, NoDriving, Transport

__all__ = ["PerPeerTransport"]


class PerPeerTransport(NoDriving):
    """Sends to ``route[peer]``; starts, resumes and closes the parts."""

    def __init__(self, rank: int, world_size: int, route: Mapping[int, Transport],
                 parts: Sequence[Transport]) -> None:
        if not set(route.values()) <= set(parts):
            raise ValueError("every transport in the route must be one of the parts")
        self.rank = rank
        self.world_size = world_size
        self._route = dict(route)
        self._parts = list(parts)

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        part = self._route.get(dst)
        if part is None:
            raise DistNetworkError(f"rank {self.rank} has no connection to rank {dst}")
        part.send(dst, header, payload, deadline)

    def start(self, handler: FrameHandler) -> None:
        for part in self._parts:
            carried = {peer for peer, p in self._route.items() if p is part}
            part.start(_Carried(handler, carried))

    def resume(self, rank: int) -> None:
        part = self._route.get(rank)
        if part is not None:
            part.resume(rank)

    def close(self) -> None:
        for part in self._parts:
            part.close()


class _Carried:
    """``handler`` as one part sees it: frames pass straight through (the handler's own
    bound methods, no extra call per frame); losses only of the peers the part carries."""

    def __init__(self, handler: FrameHandler, carried: set[int]) -> None:
        self.on_header = handler.on_header
        self.on_payload = handler.on_payload
        self.on_fatal = handler.on_fatal
        self._lost = handler.on_peer_lost
        self._carried = carried

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        if rank in self._carried:
            self._lost(rank, reason)

