"""Where the p2p rings live in their shared segment, and copying bytes through one ring.

Segment (created and shared by ``shmem/segment.py``, like the collective engine's)::

    header page (4 KiB)              int64 fields H_* (checked by a peer before use)
    n rank records (128 B each)      DOORBELL, SLEEPING, STATE, PID; written by rank r
                                     (DOORBELL also bumped by peers to wake rank r)
    n(n-1) ring controls (192 B)     HEAD/EOF (producer line), TAIL/DROPPED (consumer
                                     line), PWAIT (producer waits for room)
    n(n-1) rings of slot_bytes       ring (src, dst): bytes from src to dst (src != dst)

Why one single-producer single-consumer ring per ordered pair: each control word then
has exactly one writer, so plain aligned int64 stores suffice (atomic on x86_64) and no
lock is shared between processes. HEAD and TAIL are byte counts since the start that
only grow; the ring offset is the count modulo the capacity. Everything a peer wrote is
untrusted: ``used()`` checks ``0 <= HEAD - TAIL <= capacity`` on every look.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..shmem.layout import PAGE, SegmentLayout

__all__ = ["RingLayout", "RingView"]

REC_BYTES = 128
CTRL_BYTES = 192
# rank record fields (int64 index within the record)
DOORBELL = 0  #: futex word (low int32): bumped to wake this rank's reader or senders
SLEEPING = 1  #: 1 while this rank's reader may be inside futex_wait
STATE = 2     #: LIVE or CLOSED
PID = 3       #: for liveness checks (pidfd)
LIVE, CLOSED = 0, 1
# ring control fields (int64 index within the control block), one cache line per writer
HEAD, EOF = 0, 1         #: producer: bytes published; 1 once it closed (after HEAD)
TAIL, DROPPED = 8, 9     #: consumer: bytes consumed; 1 once it stopped reading (bad bytes)
PWAIT = 16               #: producer: 1 while it waits for room (wake it on TAIL moves)


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class RingLayout(SegmentLayout):
    """Offsets for ``nranks`` ranks with rings of ``slot_bytes`` each."""

    MAGIC: ClassVar[int] = 0x52_57_52_49_4E_47  # "RWRING"
    VERSION: ClassVar[int] = 1

    @property
    def records(self) -> int:
        return PAGE

    @property
    def controls(self) -> int:
        return _round_up(self.records + self.nranks * REC_BYTES, 64)

    @property
    def data(self) -> int:
        return _round_up(self.controls + self.slot_count * CTRL_BYTES, PAGE)

    @property
    def slot_count(self) -> int:
        return self.nranks * (self.nranks - 1)

    def _pair(self, src: int, dst: int) -> int:
        if src == dst or not (0 <= src < self.nranks and 0 <= dst < self.nranks):
            raise ValueError(f"no ring from {src} to {dst} among {self.nranks} ranks")
        return src * (self.nranks - 1) + (dst if dst < src else dst - 1)

    def rec(self, rank: int, field: int) -> int:
        """int64 index of a field of ``rank``'s record (local ranks 0..n-1)."""
        return (self.records + rank * REC_BYTES) // 8 + field

    def ctrl(self, src: int, dst: int, field: int) -> int:
        """int64 index of a control field of ring (src, dst)."""
        return (self.controls + self._pair(src, dst) * CTRL_BYTES) // 8 + field

    def ring(self, src: int, dst: int) -> int:
        """Byte offset of ring (src, dst)'s data."""
        return self.data + self._pair(src, dst) * self.slot_bytes


class RingView:
    """One ring seen from one end: its control word indices and wrap-aware copies."""

    __slots__ = ("cap", "data", "dropped", "eof", "head", "pwait", "tail")

    def __init__(self, mem: memoryview, lay: RingLayout, src: int, dst: int) -> None:
        self.cap = lay.slot_bytes
        off = lay.ring(src, dst)
        self.data = mem[off:off + self.cap]
        self.head, self.eof = lay.ctrl(src, dst, HEAD), lay.ctrl(src, dst, EOF)
        self.tail, self.dropped = lay.ctrl(src, dst, TAIL), lay.ctrl(src, dst, DROPPED)
        self.pwait = lay.ctrl(src, dst, PWAIT)

    def used(self, head: int, tail: int) -> int:
        """Bytes between ``tail`` and ``head``; -1 when the pair is impossible (a
        corrupt or hostile peer wrote it)."""
        n = head - tail
        return n if 0 <= n <= self.cap else -1

    def put(self, pos: int, src: memoryview) -> None:
        """Copy ``src`` into the ring at stream position ``pos`` (room checked by caller)."""
        at = pos % self.cap
        first = min(len(src), self.cap - at)
        self.data[at:at + first] = src[:first]
        if first < len(src):
            self.data[:len(src) - first] = src[first:]

    def get(self, pos: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes from stream position ``pos`` into ``dst``."""
        at = pos % self.cap
        first = min(len(dst), self.cap - at)
        dst[:first] = self.data[at:at + first]
        if first < len(dst):
            dst[first:] = self.data[:len(dst) - first]

    def peek(self, pos: int, n: int) -> memoryview | bytes:
        """``n`` bytes at ``pos`` without consuming them (a view when they do not wrap)."""
        at = pos % self.cap
        if at + n <= self.cap:
            return self.data[at:at + n]
        out = bytearray(n)
        self.get(pos, memoryview(out))
        return bytes(out)

    def release(self) -> None:
        self.data.release()
