"""Frames between ranks of one host through shared-memory rings (one SPSC ring per ordered
pair, see ``shm_ring.py``), read by one thread per process; the same contract as
``tcp.py``, checked by the transport conformance suite. Protocol, wake-ups, untrusted
bytes and liveness: docs/design.md, "Shared-memory transport".
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import settings
from ..errors import DistError, DistNetworkError, DistTimeout
from ..shmem.errors import ShmUnavailable
from ..shmem.futex import fence, futex_wait, futex_wake, supported
from ..shmem.liveness import PidWatch
from ..shmem.segment import Segment, StoreLike, open_segment
from ..shmem.waiting import YIELD_ENV, policy_for, usable_cpus
from ..wire.frames import DROP, HEADER, HOLD, Frame, WireError, decode_header
from .base import FrameHandler, NoDriving
from .shm_ring import CLOSED, DOORBELL, LIVE, PID, SLEEPING, STATE, RingLayout, RingView

__all__ = ["RING_BYTES_ENV", "ShmTransport"]

RING_BYTES_ENV = "RANKWISE_SHM_RING_BYTES"
#: default ring capacity per ordered pair: what the rings of a host may take together,
#: within bounds (measured, 2 ranks: 1 MiB rings moved 16 MiB at ~2 GiB/s, 4 MiB at ~4)
_RINGS_TOTAL = 64 << 20
_RING_MIN, _RING_MAX = 256 << 10, 4 << 20
_CHUNK = 256 << 10  #: bytes copied before publishing, so the other end can start
_READ_BUDGET = 8 << 20  #: bytes read from one ring before the reader looks at the others
_LIVENESS_EVERY = 0.1  #: seconds between pidfd checks of the peers
_SLEEP = 0.1  #: longest single futex sleep (every wake is explicit; this bounds checks)
_HSIZE = HEADER.size
_I32 = 0x7FFFFFFF


@dataclass(slots=True)
class _In:
    """Reader state of one incoming ring (reader thread only, except ``wake``)."""

    rank: int
    local: int
    ring: RingView
    tail: int = 0
    frame: Frame | None = None
    target: memoryview | None = None
    token: object = None
    got: int = 0
    skip: int = 0  #: payload bytes of a dropped frame still to skip
    held: bool = False
    wake: bool = False  #: ``resume`` was called (any thread)
    dead: bool = False  #: its process exited: deliver what is complete, then report
    lost: bool = False


@dataclass(slots=True)
class _Out:
    """Producer state of one outgoing ring (under ``lock``)."""

    rank: int
    local: int
    ring: RingView
    lock: threading.Lock = field(default_factory=threading.Lock)
    head: int = 0
    broken: BaseException | None = None


class ShmTransport(NoDriving):
    """One rank's end of the rings to and from the other ``ranks`` of its host."""

    def __init__(self, seg: Segment[RingLayout], rank: int, world_size: int,
                 ranks: Sequence[int]) -> None:
        if rank not in ranks or len(set(ranks)) != len(ranks) or seg.layout.nranks != len(ranks):
            raise ValueError(f"rank {rank} and local ranks {list(ranks)} do not fit a "
                             f"segment for {seg.layout.nranks} ranks")
        self.rank = rank
        self.world_size = world_size
        self._seg = seg
        lay = seg.layout
        me = list(ranks).index(rank)
        self._mem = memoryview(seg.mm).cast("B")
        self._w = self._mem.cast("q")
        anchor = ctypes.c_char.from_buffer(seg.mm)
        self._base = ctypes.addressof(anchor)
        del anchor  # drop the buffer export so close() can unmap
        self._bell = [lay.rec(r, DOORBELL) for r in range(lay.nranks)]
        self._sleeping = [lay.rec(r, SLEEPING) for r in range(lay.nranks)]
        self._state = [lay.rec(r, STATE) for r in range(lay.nranks)]
        self._pid = [lay.rec(r, PID) for r in range(lay.nranks)]
        self._me = me
        peers = [(g, i) for i, g in enumerate(ranks) if i != me]
        self._in = {g: _In(g, i, RingView(self._mem, lay, i, me)) for g, i in peers}
        self._out = {g: _Out(g, i, RingView(self._mem, lay, me, i)) for g, i in peers}
        for conn in self._in.values():  # a restarted reader resumes where it stopped
            conn.tail = int(self._w[conn.ring.tail])
        for out in self._out.values():
            out.head = int(self._w[out.ring.head])
        self._w[self._pid[me]] = os.getpid()
        self._w[self._state[me]] = LIVE
        self._handler: FrameHandler | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._attention = False  #: a resume or close: the reader re-checks its rings
        self._gone: set[int] = set()  #: peers reported lost (closed, dead, dropped)
        self._live = PidWatch()
        #: how long the reader (after a burst) and a sender out of room yield before they
        #: sleep. Not at all when the host's ranks outnumber the CPUs: each rank has two
        #: threads yielding then, and 4 ranks on 2 CPUs measured a 16 MiB all_reduce at
        #: 0.6-1.4 s with 1 ms of yielding against 160 ms sleeping at once (tcp: 130-180)
        oversubscribed = lay.nranks > usable_cpus() and settings.text(YIELD_ENV) is None
        self._yield_s = 0.0 if oversubscribed else policy_for(lay.nranks).yield_s

    @classmethod
    def open(cls, store: StoreLike, prefix: str, rank: int, world_size: int,
             ranks: Sequence[int], timeout: float, ring_bytes: int | None = None,
             method: str | None = None) -> ShmTransport:
        """Rendezvous with the other ``ranks`` (all on this host, each calling this) under
        ``prefix`` of ``store`` and map the rings. Raises ``ShmUnavailable`` on every one
        of them alike when shared memory cannot be used here. ``ring_bytes`` (default
        ``RANKWISE_SHM_RING_BYTES``, else 64 MiB shared by the n(n-1) rings, each 256 KiB
        to 4 MiB): bigger rings mean fewer waits for room on large messages."""
        if not supported():
            raise ShmUnavailable("the shared-memory transport relies on x86_64 memory "
                                 "ordering (TSO) and Linux futexes; this is not x86_64 Linux")
        n = len(ranks)
        size = ring_bytes or settings.integer(RING_BYTES_ENV, 0) or min(
            _RING_MAX, max(_RING_MIN, _RINGS_TOTAL // max(1, n * (n - 1))))
        size = max(65536, size // 65536 * 65536)
        seg = open_segment(store, prefix, list(ranks).index(rank), len(ranks),
                           slot_bytes=size, timeout=timeout, kind=RingLayout,
                           method=method or settings.choice("RANKWISE_SHM_METHOD"))
        return cls(seg, rank, world_size, ranks)

    # --- waking -----------------------------------------------------------------------

    def _ring_bell(self, local: int) -> None:
        w = self._w
        bell = self._bell[local]
        w[bell] = (w[bell] + 1) & _I32
        futex_wake(self._base + bell * 8)

    # --- sending (caller threads) --------------------------------------------------------

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        out = self._out.get(dst)
        if out is None:
            raise DistNetworkError(f"rank {self.rank} has no shared-memory ring to rank {dst}")
        if not out.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DistTimeout(f"rank {self.rank} could not send to rank {dst} before the "
                              "timeout: another send to it never finished")
        try:
            self._refuse_if_closed(out)
            body = memoryview(payload if payload is not None else b"").cast("B")
            parts = [memoryview(header).cast("B"), body] if len(body) else \
                [memoryview(header).cast("B")]
            try:
                self._write(out, parts, deadline)
            except DistError as exc:
                out.broken = exc  # part of a frame may be in the ring: its framing is lost
                raise
        finally:
            out.lock.release()

    def _refuse_if_closed(self, out: _Out) -> None:
        w = self._w
        if self._closing:
            raise DistNetworkError(f"rank {self.rank}'s transport is closed")
        if out.broken is not None or out.rank in self._gone \
                or w[self._state[out.local]] != LIVE or w[out.ring.dropped]:
            raise DistNetworkError(
                f"connection from rank {self.rank} to rank {out.rank} is closed"
            ) from out.broken

    def _write(self, out: _Out, parts: list[memoryview], deadline: float) -> None:
        ring, w = out.ring, self._w
        cap = ring.cap
        head = published = out.head
        for part in parts:
            off, n = 0, len(part)
            while off < n:
                tail = w[ring.tail]
                used = ring.used(head, tail)
                if used < 0:
                    raise DistNetworkError(
                        f"the shared-memory ring from rank {self.rank} to rank {out.rank} is "
                        f"corrupt (rank {out.rank} reported {tail} of {head} bytes read)")
                room = cap - used
                if room == 0:
                    if published != head:
                        published = self._publish(out, head)
                    self._wait_room(out, head, deadline)
                    continue
                k = min(room, n - off, _CHUNK)
                ring.put(head, part[off:off + k])
                head += k
                off += k
                if k == _CHUNK:
                    published = self._publish(out, head)
        if published != head:
            self._publish(out, head)

    def _publish(self, out: _Out, head: int) -> int:
        w = self._w
        w[out.ring.head] = out.head = head
        fence()  # the HEAD store before the SLEEPING load (Dekker, see module docstring)
        if w[self._sleeping[out.local]]:
            self._ring_bell(out.local)
        return head

    def _wait_room(self, out: _Out, head: int, deadline: float) -> None:
        """Sleep until the consumer moved TAIL (or a failure or the deadline)."""
        w, ring = self._w, out.ring
        until = time.monotonic() + self._yield_s  # the reader is likely copying:
        while time.monotonic() < until:  # room comes soon, so yield before sleeping
            os.sched_yield()
            if ring.used(head, w[ring.tail]) != ring.cap:
                return
        while True:
            self._refuse_if_closed(out)
            now = time.monotonic()
            if now >= deadline:
                raise DistTimeout(
                    f"rank {self.rank} could not send to rank {out.rank} before the timeout: "
                    f"rank {out.rank} is not reading (hung or stopped?), or it does not "
                    f"receive what rank {self.rank} sends and its room for unreceived "
                    "messages is full (RANKWISE_PARKED_PER_PEER / RANKWISE_PARKED_TOTAL): "
                    f"post the matching recv on rank {out.rank}")
            bell = self._bell[self._me]
            w[ring.pwait] = 1
            fence()  # the PWAIT store before the TAIL load
            v = w[bell]
            if ring.used(head, w[ring.tail]) == ring.cap:
                futex_wait(self._base + bell * 8, v, min(_SLEEP, deadline - now))
            w[ring.pwait] = 0
            if ring.used(head, w[ring.tail]) != ring.cap:
                return

    # --- receiving (the reader thread) -------------------------------------------------

    def start(self, handler: FrameHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=f"rankwise-shm-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def resume(self, rank: int) -> None:
        conn = self._in.get(rank)
        if conn is None or self._closing:
            return
        conn.wake = True
        self._attention = True
        self._ring_bell(self._me)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - never die silently
            err = DistError(f"the shared-memory reader of rank {self.rank} failed: "
                            f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            if self._handler is not None and not self._closing:
                try:
                    self._handler.on_fatal(err)
                except Exception:  # noqa: BLE001, S110 - nothing better left to do
                    pass

    def _loop(self) -> None:
        w, me = self._w, self._me
        bell, sleeping = self._bell[me], self._sleeping[me]
        conns = list(self._in.values())
        next_check = time.monotonic() + _LIVENESS_EVERY
        yield_s = self._yield_s
        while not self._closing:
            if self._attention:
                self._attention = False
                for conn in conns:
                    if conn.wake:
                        conn.wake = False
                        conn.held = False
            busy = False
            for conn in conns:
                if not conn.lost and not conn.held and self._serve(conn):
                    busy = True
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY
                self._check_liveness(conns)
            if busy:
                continue
            until = now + yield_s  # a reply often follows soon: yield briefly first
            while not self._ready(conns) and time.monotonic() < until:
                os.sched_yield()
            if self._ready(conns):
                continue
            w[sleeping] = 1
            fence()  # the SLEEPING store before the HEAD loads
            v = w[bell]
            if not self._ready(conns):
                futex_wait(self._base + bell * 8, v,
                           max(1e-4, min(_SLEEP, next_check - time.monotonic())))
            w[sleeping] = 0

    def _ready(self, conns: list[_In]) -> bool:
        """Anything for the reader to do (without doing it)?"""
        if self._attention or self._closing:
            return True
        w = self._w
        for conn in conns:
            if not conn.lost and not conn.held and (
                    w[conn.ring.head] != conn.tail or w[conn.ring.eof] or conn.dead):
                return True
        return False

    def _check_liveness(self, conns: list[_In]) -> None:
        w = self._w
        for conn in conns:
            if conn.lost or conn.dead:
                continue
            if not self._live.alive(conn.rank, int(w[self._pid[conn.local]])):
                conn.dead = True
                self._gone.add(conn.rank)  # sends to it fail now, held frame or not
                if conn.held and not self._held_frame_complete(conn):
                    self._lost(conn, ConnectionResetError(
                        f"rank {conn.rank} died before the end of a frame that was waiting "
                        "for room or for its receive"))

    def _held_frame_complete(self, conn: _In) -> bool:
        """A held frame that is all in the ring still waits for its receive after its
        sender died; one that is not can never complete."""
        ring, w = conn.ring, self._w
        avail = ring.used(int(w[ring.head]), conn.tail)
        try:
            n = decode_header(ring.peek(conn.tail, _HSIZE), 0, conn.rank).payload_len
        except WireError:
            return False
        return avail >= _HSIZE + n

    def _serve(self, conn: _In) -> bool:
        """Deliver what ring ``conn`` holds; True when anything moved."""
        handler = self._handler
        assert handler is not None
        w, ring = self._w, conn.ring
        eof = w[ring.eof]  # before HEAD: everything published before EOF is then seen
        head = int(w[ring.head])
        tail = conn.tail
        avail = ring.used(head, tail)
        if avail < 0:
            self._drop(conn, f"an impossible ring position (HEAD {head}, TAIL {tail}, "
                       f"capacity {ring.cap})")
            return True
        moved = False
        budget = _READ_BUDGET
        try:
            while avail and budget > 0:
                if conn.frame is None:
                    if avail < _HSIZE:
                        break
                    frame = decode_header(ring.peek(tail, _HSIZE), 0, conn.rank)
                    target, token = handler.on_header(frame)
                    if target is None and token is HOLD:
                        conn.held = True
                        break
                    tail += _HSIZE
                    avail -= _HSIZE
                    moved = True
                    conn.frame, conn.token, conn.got = frame, token, 0
                    if target is None:
                        assert token is DROP
                        conn.skip = frame.payload_len
                    else:
                        conn.target = memoryview(target).cast("B")[:frame.payload_len]
                else:
                    target = conn.target
                    want = len(target) - conn.got if target is not None else conn.skip
                    k = min(avail, want, _CHUNK)
                    if target is not None:
                        ring.get(tail, target[conn.got:conn.got + k])
                        conn.got += k
                    else:
                        conn.skip -= k
                    tail += k
                    avail -= k
                    budget -= k
                    moved = True
                    self._consumed(conn, tail)  # let the producer refill while we copy on
                if conn.frame is not None and conn.skip == 0 and (
                        conn.target is None or conn.got == len(conn.target)):
                    frame, token = conn.frame, conn.token
                    conn.frame, conn.target, conn.token = None, None, None
                    if token is not DROP:
                        handler.on_payload(frame, token)
        except WireError as exc:
            conn.tail = tail
            self._drop(conn, f"bytes that are not a valid rankwise frame ({exc})")
            return True
        if moved:
            self._consumed(conn, tail)
        # the peer is done and what is left can never become a whole frame: report it
        stuck = not avail or (conn.frame is None and avail < _HSIZE)
        if (eof or conn.dead) and stuck and not conn.held:
            if conn.frame is not None or avail or (conn.dead and not eof):
                what = "closed" if eof else "died"
                mid = " in the middle of a frame" if conn.frame is not None else ""
                self._lost(conn, ConnectionResetError(f"rank {conn.rank} {what}{mid}"))
            else:
                self._lost(conn, None)
            return True
        return moved

    def _consumed(self, conn: _In, tail: int) -> None:
        if conn.tail == tail:
            return
        w, ring = self._w, conn.ring
        w[ring.tail] = conn.tail = tail
        fence()  # the TAIL store before the PWAIT load
        if w[ring.pwait]:
            self._ring_bell(conn.local)

    def _drop(self, conn: _In, what: str) -> None:
        """Protocol error: stop reading this peer, make its sends fail, report it."""
        self._w[conn.ring.dropped] = 1
        fence()
        self._ring_bell(conn.local)
        self._lost(conn, DistNetworkError(
            f"rank {conn.rank} sent {what} on its shared-memory ring to rank {self.rank}; "
            "connection dropped"))

    def _lost(self, conn: _In, reason: BaseException | None) -> None:
        conn.lost = True
        conn.held = False
        self._gone.add(conn.rank)
        if not self._closing and self._handler is not None:
            self._handler.on_peer_lost(conn.rank, reason)

    # --- no driving: the reader thread always reads ---------------------------------------

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Mark every outgoing ring EOF (after its frames), wake the peers, stop the
        reader, unmap. A sender still copying keeps the mapping alive (it fails at its
        next check, and the mapping goes with the process)."""
        if self._closing:
            return
        self._closing = True
        w = self._w
        for out in self._out.values():
            w[out.ring.eof] = 1
        w[self._state[self._me]] = CLOSED
        fence()
        for out in self._out.values():
            self._ring_bell(out.local)
        self._ring_bell(self._me)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return
        self._live.close()
        locks = [out.lock for out in self._out.values()]
        taken = [lock for lock in locks if lock.acquire(timeout=1.0)]
        try:
            if len(taken) == len(locks):
                self._unmap()
        finally:
            for lock in taken:
                lock.release()

    def _unmap(self) -> None:
        for conn in self._in.values():
            conn.ring.release()
            conn.target = None
        for out in self._out.values():
            out.ring.release()
        self._w.release()
        self._mem.release()
        try:
            self._seg.mm.close()
        except BufferError:
            pass  # a caller still holds a view into it: the process exit unmaps it
