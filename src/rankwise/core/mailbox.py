"""A router's mailboxes: posted receives (``Pending``), parked arrivals, and each group's
calls as the router knows them (``GroupState``). Split from ``core.router``, which
matches frames to them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import settings
from ..errors import DistTimeout
from ..identity.calls import Fingerprint
from ..wire.buffers import dtype_by_code
from ..wire.frames import LANE_FLAGS, Flag, Frame, Op

__all__ = ["CHECK_LANE", "OVERHEAD", "PARKED_PER_PEER", "PARKED_TOTAL", "Arrival", "CollKey",
           "GroupState", "Pending", "call_bytes", "coll_key", "env_bytes", "uninitialized"]

#: (group, seq, source global rank, step, lane flags): one message of one collective call
CollKey = tuple[int, int, int, int, int]


def coll_key(frame: Frame) -> CollKey:
    """The receive a collective frame belongs to."""
    return (frame.group, frame.seq, frame.src, frame.step, frame.flags & LANE_FLAGS)


class Pending:
    """A posted receive: completes when its payload has landed, or with an error.

    Waiting blocks in the kernel (a lock acquire with timeout), never spins.
    """

    __slots__ = ("_done", "buffer", "completed", "error", "frame", "group", "nbytes", "src",
                 "tag")

    def __init__(self, buffer: memoryview | None, src: int, tag: int = 0, group: int = 0) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.buffer = buffer  #: destination; None means "allocate what arrives" (objects)
        self.nbytes = -1 if buffer is None else buffer.nbytes
        self.src = src  #: -1 for any source
        self.tag = tag
        self.group = group
        self.error: BaseException | None = None
        self.frame: Frame | None = None
        self.completed = False

    def finish(self, frame: Frame | None, error: BaseException | None = None) -> None:
        if self.completed:
            return
        self.frame = frame
        self.error = error
        self.completed = True
        self._done.release()

    def wait(self, deadline: float, describe: Callable[[], str]) -> Frame:
        """Block until done or ``deadline`` (time.monotonic); raise the error if any."""
        if not self.completed:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._done.acquire(timeout=remaining):
                raise DistTimeout(describe())
            self._done.release()
        if self.error is not None:
            raise self.error
        assert self.frame is not None
        return self.frame


def uninitialized(n: int) -> memoryview:
    """Room for a parked payload; not zero-filled (it is overwritten at once)."""
    return memoryview(np.empty(n, np.uint8).data) if n else memoryview(b"")


@dataclass(slots=True)
class Arrival:
    frame: Frame
    data: memoryview
    complete: bool = False
    waiter: Pending | None = None
    parked: int = 0  #: bytes charged to the parking caps until it is taken


#: what parking a frame costs beyond its payload (bookkeeping), so that a flood of empty
#: frames is bounded too
OVERHEAD = 256


def env_bytes(name: str, default: int) -> int:
    return settings.integer(name, default)


#: defaults of the parking caps (read from the environment when a Router is made)
PARKED_PER_PEER = 64 << 20
PARKED_TOTAL = 256 << 20
#: the ring check's lane (a plain int: the lane is compared per frame)
CHECK_LANE = int(Flag.CHECK)


def call_bytes(fp: Fingerprint) -> int | None:
    """The most payload bytes one frame of the call ``fp`` can carry (None: unknown)."""
    if fp.count < 0:
        return None
    if fp.dtype == 0:  # a barrier's count is a name code, its frames are empty
        return 0 if fp.op == Op.barrier else None
    d = dtype_by_code(fp.dtype)
    return None if d is None else fp.count * d.storage.itemsize




@dataclass(slots=True)
class GroupState:
    calls: dict[int, Fingerprint] = field(default_factory=dict)
    #: per call, the header fields (op, dtype, reduce, flags, root, count) a matching frame
    #: carries, compared in one step on the hot path; absent where counts may differ.
    #: A frame of another lane (lane flags set) misses it and takes the full path.
    wire: dict[int, tuple[int, ...]] = field(default_factory=dict)
    early: dict[int, list[Frame]] = field(default_factory=dict)
    #: ring-check frames (``Flag.CHECK``, no payload) that matched our call while no
    #: receive was posted for them: seq -> sender. A confirmed call never posts one (see
    #: ``take_checks``); a first-sight call that posts after its frame came finds it here
    checked: dict[int, int] = field(default_factory=dict)
    #: our confirmed calls' ring-check entries as the neighbour must send them (seq and
    #: fingerprint, ``CHECK_KEY`` bytes), by seq: ``take_checks`` compares bytes to bytes
    expected: dict[int, bytes] = field(default_factory=dict)
    #: ring-check entries of a ``Kind.CHECKS`` frame that came before our call #seq was
    #: made (the neighbour is ahead): seq -> the entry's frame, judged by
    #: ``register_call`` against the call; at most ``EARLY_WINDOW`` calls ahead
    early_checks: dict[int, Frame] = field(default_factory=dict)
    #: the last call registered (``register_call``): how far ahead an entry is
    last: int = 0
    #: the calls before this one have no records left (``router._trim``)
    trimmed: int = 0
