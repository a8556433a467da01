"""Where everything lives in a group's segment (offsets only; no I/O here).

Why one module: the creator and every peer must agree byte for byte, and the lengths a
peer reads back (header fields, site-text lengths) must be checked against the same
numbers. Everything is int64 and 64-byte aligned so that each field is written by a
single aligned store (atomic on x86_64) and per-rank control data never shares a cache
line with another rank's (no false sharing between publishers).

Segment::

    header page (4 KiB)          int64 fields H_*
    n rank records (256 B each)  int64 fields R_*; record r is written only by rank r
    n site-text areas (2 KiB)    UTF-8 call-site text of rank r's current call
    n x 2 data slots             slot (r, parity) of slot_bytes, written only by rank r
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["MAGIC", "VERSION", "Layout", "SegmentLayout"]

MAGIC = 0x52_57_53_48_4D_31  # "RWSHM1"
#: 2: the fingerprint has a flags word (FP_FLAGS); 3: site id last; 4: one futex word for
#: the group (H_WAKE) instead of one per rank
VERSION = 4
PAGE = 4096

# header fields (int64 index)
H_MAGIC, H_VERSION, H_NRANKS, H_SLOT_BYTES, H_TOTAL = range(5)
#: the group's futex word (low int32, its own cache line): the rank that completes a round
#: changes it and wakes every sleeping rank with one FUTEX_WAKE (``engines/shm/channel.py``)
H_WAKE = 8

RECORD_BYTES = 256
RECORD_WORDS = RECORD_BYTES // 8
# rank record fields (int64 index within the record)
R_SEQ = 0        #: rounds this rank has published; monotonically increasing
R_FUTEX = 1      #: unused since VERSION 4 (the group's H_WAKE replaced it)
R_SLEEPING = 2   #: 1 while this rank may be inside futex_wait
R_STATE = 3      #: STATE_* below
R_PID = 4        #: this rank's pid, for liveness checks
R_SITE_LEN = 5   #: bytes of call-site text in this rank's site area
R_SITE_ID = 6    #: call-site id whose text is in the site area
R_FP = (8, 16)   #: fingerprint for rounds of parity 0 / 1 (FP_* fields follow)
FP_OP, FP_DTYPE, FP_COUNT, FP_REDUCE, FP_ROOT, FP_FLAGS, FP_SEQ, FP_SITE = range(8)
FP_WORDS = 8
#: the leading words every rank's fingerprint must equal byte for byte (all but the site:
#: ranks may call from different lines), so one slice comparison checks a peer
FP_COMPARED = 7

STATE_LIVE, STATE_CLOSED, STATE_FAILED = 0, 1, 2

SITE_BYTES = 2048


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """What every segment shares, whatever lives in it: the header page (fields ``H_*``,
    checked by a peer before it trusts any size) and ``slot_count`` equal data slots of
    ``slot_bytes`` from offset ``data`` on. ``segment.py`` creates, shares and sizes any
    subclass the same way (the collective engine's ``Layout``, the p2p transport's rings).
    """

    nranks: int
    slot_bytes: int
    MAGIC: ClassVar[int] = 0  #: tells one kind of segment from another
    VERSION: ClassVar[int] = 0

    @property
    def data(self) -> int:
        raise NotImplementedError

    @property
    def slot_count(self) -> int:
        raise NotImplementedError

    @property
    def total(self) -> int:
        return self.data + self.slot_count * self.slot_bytes

    @classmethod
    def for_total(cls, nranks: int, total_budget: int) -> int:
        """The largest slot size (a multiple of 64 KiB, at least 64 KiB) whose segment
        fits in ``total_budget`` bytes; 0 when even that does not fit."""
        probe = cls(nranks, 0)
        per_slot = (total_budget - probe.data) // probe.slot_count
        return max(0, per_slot // 65536 * 65536)


@dataclass(frozen=True, slots=True)
class Layout(SegmentLayout):
    """Byte offsets of a segment for ``nranks`` ranks and ``slot_bytes`` per slot."""

    MAGIC: ClassVar[int] = MAGIC
    VERSION: ClassVar[int] = VERSION

    @property
    def records(self) -> int:
        return PAGE

    @property
    def sites(self) -> int:
        return _round_up(self.records + self.nranks * RECORD_BYTES, 64)

    @property
    def data(self) -> int:
        return _round_up(self.sites + self.nranks * SITE_BYTES, PAGE)

    @property
    def slot_count(self) -> int:
        return 2 * self.nranks

    def record_word(self, rank: int, field: int) -> int:
        """Index (in int64 words from the segment start) of a rank-record field."""
        return (self.records + rank * RECORD_BYTES) // 8 + field

    def site(self, rank: int) -> int:
        return self.sites + rank * SITE_BYTES

    def slot(self, rank: int, parity: int) -> int:
        return self.data + (2 * rank + parity) * self.slot_bytes
