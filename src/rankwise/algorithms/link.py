"""What an algorithm sees of the world: numbered peers, sends, posted receives, a reducer.

Why: the collectives are pure message schedules. Written against this interface they
never see a socket, a header or a deadline, and run unchanged over tcp, the in-memory
test transport, or any later transport. Ranks here are group-local (0..size-1); a step
number tells apart the several messages one peer sends in one operation, and a ``Lane``
keeps a message that is not one of the numbered data steps (a clear-to-send, a final
gather) apart from them without reserving a magic step number for it.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import numpy.typing as npt

__all__ = ["Handle", "Lane", "Link"]

Array = npt.NDArray[Any]


class Lane(enum.IntEnum):
    """Which series of one operation's messages a step number counts in; the link maps
    it to header flags (the algorithms never see wire bits)."""

    DATA = 0  #: the numbered steps of the schedule
    CTS = 1  #: clear-to-send: "my receives are posted" (``ring``)
    GATHER = 2  #: reduced chunks sent to the root after a reduce-scatter (``tree``)


class Handle(Protocol):
    """A posted receive; ``Link.wait`` completes it."""


class Link(Protocol):
    rank: int
    size: int

    def send(self, peer: int, data: Array, step: int, lane: Lane = Lane.DATA) -> None:
        """Send ``data`` (contiguous, 1-D) to ``peer``; returns once the network has it."""

    def post(self, peer: int, out: Array, step: int, lane: Lane = Lane.DATA) -> Handle:
        """Arrange for the message (peer, step, lane) to land in ``out`` (exact size)."""

    def wait(self, handle: Handle) -> None:
        """Block until the posted receive is complete (bounded by the op's deadline)."""

    def reduce(self, acc: Array, incoming: Array) -> None:
        """``acc = op(acc, incoming)`` with the call's reduce op and dtype."""

    def finish_avg(self, acc: Array) -> None:
        """Divide an accumulated sum by the group size, if the op is AVG."""


def recv(link: Link, peer: int, out: Array, step: int) -> None:
    link.wait(link.post(peer, out, step))
