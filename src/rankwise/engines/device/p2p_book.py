"""Matching point-to-point messages on a data plane without tags (NCCL), by header.

Why: NCCL's send/recv carry no tag and match in the order they are posted, per pair and
direction; rankwise's p2p matches (source, tag) in arrival order, and a size or dtype
mismatch must be an error, not a hang or corrupt data. So every device message is
announced by a small header on rankwise's control plane (``Header``: the sender's
per-destination message number, tag, dtype, size, shape, call site), and the receiver
decides from the headers which NCCL receive comes next.

The guarantee (docs/gpu.md, "Point-to-point on NCCL"): a receive takes the first
message, in arrival order, from its source (or any) with its tag, and receives are
served in the order they were posted -- exactly the host path's rule. NCCL receives are
issued per source in the senders' order: taking message ``k`` from a source first
receives every earlier message of that source nobody has asked for yet into a scratch
tensor ("stash"; copied out when its receive is posted). A header is compared with its
receive before anything is issued: a mismatch fails that receive, NCCL is not entered.

Pure logic (no torch, no I/O): what a receive issues is passed in (``issue``), so the
matching is tested in-process with fakes.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import DistError

__all__ = ["Header", "HeaderMatcher", "Receive", "decode", "encode"]

_FIXED = struct.Struct("<QqiqqBH")  #: number, tag, dtype, numel, nbytes, ndim, site length
_DIM = struct.Struct("<q")
#: a header's bounds: the decoder treats every byte as hostile
MAX_DIMS = 64
MAX_SITE = 1024


@dataclass(frozen=True)
class Header:
    """One device message as its sender announced it."""

    src: int  #: the sender's global rank (from the frame, never from the payload)
    number: int  #: its place among the sender's device messages to this rank (from 0)
    tag: int
    dtype: int  #: rankwise's dtype code
    numel: int
    nbytes: int
    shape: tuple[int, ...]
    site: str  #: the sender's call site, short (``train.py:42``)


def encode(h: Header) -> bytes:
    site = h.site.encode("utf-8", "replace")[:MAX_SITE]
    shape = h.shape[:MAX_DIMS]
    return _FIXED.pack(h.number, h.tag, h.dtype, h.numel, h.nbytes, len(shape), len(site)) \
        + b"".join(_DIM.pack(d) for d in shape) + site


def decode(src: int, payload: bytes) -> Header:
    """The header ``src`` sent; ``DistError`` for bytes that are not one."""
    n = len(payload)
    if n < _FIXED.size:
        raise DistError(f"rank {src} sent a device p2p header of {n} bytes (corrupt peer?)")
    number, tag, dtype, numel, nbytes, ndim, nsite = _FIXED.unpack_from(payload)
    end = _FIXED.size + ndim * _DIM.size + nsite
    if ndim > MAX_DIMS or nsite > MAX_SITE or end != n or number < 0 or numel < 0 \
            or nbytes < 0:
        raise DistError(f"rank {src} sent a malformed device p2p header (corrupt peer?)")
    shape = tuple(_DIM.unpack_from(payload, _FIXED.size + i * _DIM.size)[0]
                  for i in range(ndim))
    site = payload[end - nsite:end].decode("utf-8", "replace")
    return Header(src, number, tag, dtype, numel, nbytes, shape, site)


class Receive:
    """One posted receive: what it accepts, and (once matched) what it got."""

    def __init__(self, src: int, tag: int, dtype: int, numel: int, target: Any,
                 describe: Callable[[], str], call: Any = None) -> None:
        self.src = src  #: -1: any source
        self.tag = tag
        self.dtype = dtype
        self.numel = numel
        self.target = target  #: where the data goes (handed to ``issue``)
        self.describe = describe  #: the receive in words, with its call site
        self.call = call  #: the API's call (deadline, wording), for the data plane
        self.header: Header | None = None
        self.handle: Any = None  #: what ``issue`` returned for it
        self.stash: Any = None  #: the handle of a stashed message it took instead
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def accepts(self, h: Header) -> bool:
        return (self.src == -1 or self.src == h.src) and self.tag == h.tag


#: ``issue(header, receive, scratch)``: start the data plane's receive of ``header``'s
#: message into ``receive.target`` (``scratch``: into a scratch buffer of its size, for
#: a later receive; ``receive`` is the one that made it necessary); returns a handle
Issue = Callable[[Header, Receive, bool], Any]
#: ``mismatch(header, receive)``: the error for a header its receive does not fit
Mismatch = Callable[[Header, Receive], BaseException]


class HeaderMatcher:
    """The headers and posted receives of one group on one rank (thread-safe)."""

    def __init__(self, issue: Issue, mismatch: Mismatch) -> None:
        self._issue = issue
        self._mismatch = mismatch
        self._lock = threading.Lock()
        self._arrived: list[Header] = []  #: not yet taken, arrival order
        self._posted: list[Receive] = []  #: not yet matched, post order
        self._stashed: dict[tuple[int, int], Any] = {}  #: received early, by (src, number)
        self._expect: dict[int, int] = {}  #: the next header number, per source
        #: sources whose message stream a mismatch broke: a message of theirs was never
        #: received, so nothing after it can be (NCCL would hand out its bytes)
        self._broken: dict[int, BaseException] = {}
        self.stash_bytes = 0  #: scratch memory held by stashed messages

    def post(self, r: Receive) -> None:
        with self._lock:
            for h in self._arrived:
                if r.accepts(h):
                    self._take(h, r)
                    return
            self._posted.append(r)

    def arrive(self, h: Header) -> None:
        """A header came (per source, in the order it was sent)."""
        with self._lock:
            expected = self._expect.get(h.src, 0)
            if h.number != expected:
                raise DistError(f"rank {h.src} sent device p2p message #{h.number} where "
                                f"#{expected} was next (corrupt peer?)")
            self._expect[h.src] = expected + 1
            for i, r in enumerate(self._posted):
                if r.accepts(h):
                    del self._posted[i]
                    self._arrived.append(h)
                    self._take(h, r)
                    return
            self._arrived.append(h)

    def cancel(self, r: Receive) -> None:
        """Forget a receive whose waiter gave up (nothing is issued into it later)."""
        with self._lock:
            if r in self._posted:
                self._posted.remove(r)

    def untaken(self, src: int) -> list[int]:
        """The tags of the messages from ``src`` (-1: any) nobody has taken yet."""
        with self._lock:
            return [h.tag for h in self._arrived if src in (-1, h.src)]

    def pending(self) -> int:
        with self._lock:
            return len(self._posted)

    def _take(self, h: Header, r: Receive) -> None:
        """``r`` takes ``h`` (lock held, ``h`` in ``_arrived``): check, then issue in order."""
        self._arrived.remove(h)
        r.header = h
        try:
            key = (h.src, h.number)
            if key in self._stashed:  # received already: its data was checked when sent
                if h.dtype == r.dtype and h.numel == r.numel:
                    r.stash = self._stashed.pop(key)
                    self.stash_bytes -= h.nbytes
                    return
            elif h.src in self._broken:
                r.error = self._broken[h.src]
                return
            if h.dtype != r.dtype or h.numel != r.numel:
                r.error = self._broken[h.src] = self._mismatch(h, r)
                return
            stashed = self._stashed
            for early in [e for e in self._arrived if e.src == h.src
                          and e.number < h.number and (e.src, e.number) not in stashed]:
                stashed[(early.src, early.number)] = self._issue(early, r, True)
                self.stash_bytes += early.nbytes
            r.handle = self._issue(h, r, False)
        except BaseException as exc:  # noqa: BLE001 - the receive's waiter raises it
            r.error = exc
        finally:
            r.ready.set()
