"""One ``Transport`` made of several: each peer is reached by the one that suits it.

Why: in a job spread over hosts, the ranks of one host should talk through shared memory
and the others through TCP; the layers above see one transport either way. Each part
keeps its own reader thread and delivers to the same handler (the router locks its own
state, so two readers are fine). Driving (``drive_begin``) is declined: a driver would
read only one part while frames of the other still need their own thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import DistNetworkError
from .base import FrameHandler, Transport

__all__ = ["PerPeerTransport"]


class PerPeerTransport:
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
            part.start(handler)

    def resume(self, rank: int) -> None:
        part = self._route.get(rank)
        if part is not None:
            part.resume(rank)

    def drive_begin(self) -> bool:
        return False

    def drive_end(self) -> None:
        return None

    def driving(self) -> bool:
        return False

    def progress(self, timeout: float) -> None:
        raise RuntimeError("PerPeerTransport has no driver: drive_begin() is always False")

    def close(self) -> None:
        for part in self._parts:
            part.close()
