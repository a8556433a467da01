"""Matching arriving frames to the receives that ranks have posted.

Why a separate piece: the transport only moves frames; deciding *where* a payload goes
(straight into a posted user buffer, or into a parked copy until the receive is posted),
checking each collective frame against this rank's own call before its payload is
used, and failing every waiter at once when something goes wrong is the same logic for
every transport (tcp, in-memory).

Three namespaces never mix:
- collectives, matched exactly by (group, seq, src, step, lane) (``coll_key``; the lane
  is the frame's lane flags, ``wire.frames.LANE_FLAGS``);
- user point-to-point, matched by (src or any, tag) in arrival order, as MPI does;
- library-internal object messages (``Kind.OBJ``), matched like p2p but separately, so
  that ``recv(src=None)`` can never swallow a library message.

What is parked (arrived, nobody asked for it yet) is bounded per peer and in total
(``RANKWISE_PARKED_PER_PEER``, default 64 MiB; ``RANKWISE_PARKED_TOTAL``, default
256 MiB): a frame that would pass a cap is answered ``HOLD``, the transport stops
reading that peer, and TCP flow control makes its sender wait (bounded by the sender's
deadline) until a receive is posted for it or parked messages are taken. Nothing a
header claims is allocated before it is known to fit: a collective frame larger than
the call it belongs to can hold is a protocol error naming its sender.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import DistError, DistTimeout
from ..identity.calls import Fingerprint
from ..wire.buffers import dtype_by_code
from ..wire.frames import (
    CHECK_ENTRY,
    CHECK_KEY,
    DROP,
    HOLD,
    LANE_FLAGS,
    Flag,
    Frame,
    Kind,
    Op,
    WireError,
    decode_checks,
)

__all__ = ["CollKey", "Pending", "Router", "coll_key"]

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


def _uninitialized(n: int) -> memoryview:
    """Room for a parked payload; not zero-filled (it is overwritten at once)."""
    return memoryview(np.empty(n, np.uint8).data) if n else memoryview(b"")


@dataclass(slots=True)
class _Arrival:
    frame: Frame
    data: memoryview
    complete: bool = False
    waiter: Pending | None = None
    parked: int = 0  #: bytes charged to the parking caps until it is taken


#: what parking a frame costs beyond its payload (bookkeeping), so that a flood of empty
#: frames is bounded too
_OVERHEAD = 256


def _env_bytes(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


#: defaults of the parking caps (read from the environment when a Router is made)
PARKED_PER_PEER = 64 << 20
PARKED_TOTAL = 256 << 20
#: the ring check's lane (a plain int: the lane is compared per frame)
_CHECK_LANE = int(Flag.CHECK)
_ENTRY = CHECK_ENTRY.size
_seq_of = struct.Struct("<Q").unpack_from  #: an entry's seq (its first field)
#: calls whose expected ring-check entries are kept (a neighbour is never further behind)
_EXPECT_KEEP = 1024


def call_bytes(fp: Fingerprint) -> int | None:
    """The most payload bytes one frame of the call ``fp`` can carry (None: unknown)."""
    if fp.count < 0:
        return None
    if fp.dtype == 0:  # a barrier's count is a name code, its frames are empty
        return 0 if fp.op == Op.barrier else None
    d = dtype_by_code(fp.dtype)
    return None if d is None else fp.count * d.storage.itemsize




@dataclass(slots=True)
class _GroupState:
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


#: called as (frame, our fingerprint or None, extra detail) when a frame contradicts our call
MismatchHandler = Callable[[Frame, "Fingerprint | None", str], None]
#: called as (sender's global rank, message) when a peer breaks the protocol
ProtocolErrorHandler = Callable[[int, str], None]


class Router:
    """Thread-safe mailboxes shared by the I/O thread (producer) and callers (consumers)."""

    def __init__(self, on_mismatch: MismatchHandler,
                 on_protocol_error: ProtocolErrorHandler | None = None,
                 per_peer: int | None = None, total: int | None = None) -> None:
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  #: a failure or a departure was noted
        self._on_mismatch = on_mismatch
        self._on_protocol_error = on_protocol_error
        self.per_peer_cap = per_peer or _env_bytes("RANKWISE_PARKED_PER_PEER", PARKED_PER_PEER)
        self.total_cap = total or _env_bytes("RANKWISE_PARKED_TOTAL", PARKED_TOTAL)
        self._parked: dict[int, int] = {}  #: bytes parked per source rank
        self._parked_total = 0
        #: peers whose transport stopped reading because a frame did not fit (see HOLD)
        self._held: set[int] = set()
        #: the transport's "read from this peer again" (set by whoever owns both)
        self.resume: Callable[[int], None] | None = None
        self._coll_posted: dict[CollKey, Pending] = {}
        self._coll_arrived: dict[CollKey, _Arrival] = {}
        self._p2p_posted: dict[int, list[Pending]] = {Kind.P2P: [], Kind.OBJ: []}
        self._p2p_arrived: dict[int, deque[_Arrival]] = {Kind.P2P: deque(), Kind.OBJ: deque()}
        self._groups: dict[int, _GroupState] = {}
        self._failed: BaseException | None = None
        self._gone: dict[int, BaseException] = {}  #: peers that left or died
        #: told (once, outside the lock) of the first failure: engines whose data plane
        #: rankwise does not own (a torch group) abort it so no rank stays blocked there
        self.on_failure: list[Callable[[BaseException], None]] = []

    # --- state shared with callers ---------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        return self._failed

    def peer_gone(self, rank: int) -> BaseException | None:
        return self._gone.get(rank)

    def wait_for_cause(self, rank: int, timeout: float) -> BaseException | None:
        """Block (at most ``timeout``) until the reader has noted why the connection to
        ``rank`` broke: what the peer sent before it closed (an abort it relays, its
        goodbye) names the real cause better than the broken pipe does."""
        with self._news:
            self._news.wait_for(lambda: self._failed is not None or rank in self._gone,
                                timeout)
            return self._failed or self._gone.get(rank)

    def wait_for_any_cause(self, ranks: list[int], timeout: float) -> BaseException | None:
        """Like ``wait_for_cause``, for whichever of ``ranks`` is noted gone first (or a
        failure of the whole job): what explains a foreign engine's broken op."""
        def cause() -> BaseException | None:  # the first to go (dicts keep order)
            return self._failed or next((exc for r, exc in self._gone.items() if r in ranks),
                                        None)
        with self._news:
            self._news.wait_for(lambda: cause() is not None, timeout)
            return cause()

    def register_call(self, group: int, seq: int, fp: Fingerprint, keep: int = 1024) -> None:
        """Record this rank's call #seq; check frames that arrived before it was made."""
        with self._lock:
            # (not ``setdefault(group, _GroupState())``: that built a state, four dicts,
            # on every call only to throw it away)
            state = self._groups.get(group) or self._groups.setdefault(group, _GroupState())
            state.calls[seq] = fp
            state.calls.pop(seq - keep, None)
            if fp.count != -1:
                state.wire[seq] = (fp.op, fp.dtype, fp.reduce, fp.flags, fp.root, fp.count)
            state.wire.pop(seq - keep, None)
            state.checked.pop(seq - keep, None)
            state.expected.pop(seq - keep, None)
            bad: list[Frame] = []
            for f in state.early.pop(seq, ()):
                if fp.differs(f):  # parked before we made the call: never deliver it
                    bad.append(f)
                    gone = self._coll_arrived.pop(coll_key(f), None)
                    if gone is not None:
                        self._unpark_locked(gone)
                elif f.flags & LANE_FLAGS == _CHECK_LANE and not f.payload_len:
                    # a ring-check frame judged good now: a confirmed call never takes it
                    # (``take_checks``), so it leaves the parked frames for ``checked``
                    key = coll_key(f)
                    arrival = self._coll_arrived.get(key)
                    if arrival is not None and arrival.complete and arrival.waiter is None:
                        del self._coll_arrived[key]
                        self._unpark_locked(arrival)
                        state.checked[seq] = f.src
            held = self._take_held()
        for frame in bad:
            self._on_mismatch(frame, fp, "")
        self._resume_all(held)  # a held frame of this call can now be judged against it

    def check_alive(self, peers: list[int] | range | None = None) -> None:
        """Raise the failure that makes communication pointless, if there is one."""
        if self._failed is not None:
            raise self._failed
        if peers is not None and self._gone:
            for p in peers:
                exc = self._gone.get(p)
                if exc is not None:
                    raise exc

    # --- posting receives (caller threads) -------------------------------------------

    def post_coll(self, key: CollKey, buffer: memoryview) -> Pending:
        pending = Pending(buffer, key[2])
        copy_from: _Arrival | None = None
        with self._lock:
            if self._failed is not None:
                pending.finish(None, self._failed)
                return pending
            gone = self._gone.get(key[2])
            arrival = self._coll_arrived.pop(key, None)
            held = self._take_held()
            judged = self._judged_locked(key) if arrival is None and key[4] else None
            if judged is not None:
                pending.finish(judged)
            elif arrival is None:
                if gone is not None:
                    pending.finish(None, gone)
                else:
                    self._coll_posted[key] = pending
            elif arrival.complete:
                copy_from = arrival
            else:
                arrival.waiter = pending
        if copy_from is not None:
            self._deliver_copy(copy_from, pending)
        self._resume_all(held)
        return pending

    def _judged_locked(self, key: CollKey) -> Frame | None:
        """The ring-check frame for ``key`` that matched our call before this receive
        was posted (lock held), taken; None when there is none."""
        state = self._groups.get(key[0])
        if state is None or key[3] or key[4] != _CHECK_LANE or \
                state.checked.get(key[1]) != key[2]:
            return None
        del state.checked[key[1]]
        return self._judged_frame(state, key[0], key[1], key[2])

    def expect_check(self, group: int, seq: int, key: bytes) -> None:
        """Our confirmed call #seq's ring-check entry as the neighbour must send it (the
        first ``CHECK_KEY`` bytes of ``CHECK_ENTRY``: seq and fingerprint, not the call
        site), for ``take_checks``. No lock: one dict store is atomic, and an entry that
        comes before it is stored takes the full path, which judges it just as well."""
        state = self._groups.get(group)  # made by register_call, before any check
        if state is not None:
            expected = state.expected
            expected[seq] = key
            expected.pop(seq - _EXPECT_KEEP, None)

    def take_checks(self, frame: Frame, payload: bytes) -> list[Frame]:
        """Judge a ``Kind.CHECKS`` frame (the neighbour's confirmed calls, see
        ``engines.ring_check``) in one pass under the lock: an entry equal, byte for
        byte, to the one we expect (``expect_check``) is settled at once. The entries
        this cannot settle (early, mismatched, awaited by a receive of another size) are
        returned as the frames they stand for, in order, for the full path
        (``coll_header``), which validates them as hostile bytes.

        Why: a confirmed call posts no receive for its neighbour's fingerprint (it never
        waits for it), so an entry needs only comparing with our own call. Through the
        full path each entry cost a frame object, a receive posted by the caller and a
        header-and-payload hand-off here, on the I/O thread and under the GIL: on two
        cores more than the 4-byte op it checks."""
        n = len(payload)
        state = self._groups.get(frame.group)
        if state is None or n % _ENTRY:
            return decode_checks(frame, payload)  # (raises on a torn payload)
        group, src, step = frame.group, frame.src, frame.step
        rest: list[int] = []
        done: list[tuple[Pending, int]] = []
        with self._lock:
            expected, checked, posted = state.expected, state.checked, self._coll_posted
            for off in range(0, n, _ENTRY):
                seq = _seq_of(payload, off)[0]
                if step or expected.get(seq) != payload[off:off + CHECK_KEY]:
                    rest.append(off)
                    continue
                pending = posted.pop((group, seq, src, 0, _CHECK_LANE), None) \
                    if posted else None
                if pending is None:
                    checked[seq] = src  # a first-sight call may post for it yet
                elif pending.nbytes == 0:
                    done.append((pending, seq))
                else:
                    posted[(group, seq, src, 0, _CHECK_LANE)] = pending
                    rest.append(off)
            judged = [(p, self._judged_frame(state, group, seq, src)) for p, seq in done]
        for pending, f in judged:
            pending.finish(f)
        if not rest:
            return []
        return decode_checks(frame, b"".join(payload[o:o + _ENTRY] for o in rest))

    @staticmethod
    def _judged_frame(state: _GroupState, group: int, seq: int, src: int) -> Frame:
        fp = state.calls[seq]
        return Frame(Kind.COLL, group, seq, fp.op, fp.dtype, fp.reduce,
                     fp.flags | _CHECK_LANE, fp.root, fp.count, 0, 0, 0, 0, src)

    def post_p2p(self, kind: int, group: int, src: int, tag: int,
                 buffer: memoryview | None) -> Pending:
        """Point-to-point receives match (group, source or any, tag), in arrival order:
        each group is its own namespace, as each torch process group is."""
        pending = Pending(buffer, src, tag, group)
        with self._lock:
            held = self._take_held()
            copy_from = self._match_p2p_locked(kind, pending)
        if copy_from is not None:
            self._deliver_copy(copy_from, pending)
        self._resume_all(held)  # a held frame may be the one this receive waits for
        return pending

    def _match_p2p_locked(self, kind: int, pending: Pending) -> _Arrival | None:
        """Post ``pending`` (lock held); the complete arrival to copy from, if one matched."""
        if self._failed is not None:
            pending.finish(None, self._failed)
            return None
        src, tag, group = pending.src, pending.tag, pending.group
        queue = self._p2p_arrived[kind]
        for arrival in queue:
            f = arrival.frame
            if (src == -1 or f.src == src) and f.tag == tag and f.group == group \
                    and arrival.waiter is None:
                queue.remove(arrival)
                if not arrival.complete:
                    arrival.waiter = pending
                    return None
                return arrival
        if src != -1 and src in self._gone:
            pending.finish(None, self._gone[src])
            return None
        self._p2p_posted[kind].append(pending)
        return None

    def cancel(self, pending: Pending) -> None:
        """Forget a receive whose waiter gave up (timeout), so nothing lands in it later."""
        with self._lock:
            for k, p in list(self._coll_posted.items()):
                if p is pending:
                    del self._coll_posted[k]
            for lst in self._p2p_posted.values():
                if pending in lst:
                    lst.remove(pending)

    # --- arrivals (I/O thread) -------------------------------------------------------

    def on_header(self, frame: Frame) -> tuple[memoryview | None, object]:
        """Decide where the payload of ``frame`` goes: a writable buffer and a token
        that the transport passes to ``on_payload`` once the buffer is filled."""
        if frame.kind == Kind.COLL:
            return self.coll_header(frame)
        return self._p2p_header(frame)

    def coll_header(self, frame: Frame) -> tuple[memoryview | None, object]:
        """``on_header`` for a collective frame.

        The common case first: the frame matches our call and its receive is posted
        with the right size. Anything else (early, parked, mismatched) takes the full path.
        """
        # coll_key(frame), inlined: this runs for every collective frame
        key = (frame.group, frame.seq, frame.src, frame.step, frame.flags & LANE_FLAGS)
        with self._lock:
            state = self._groups.get(frame.group)
            if state is not None and state.wire.get(frame.seq) == frame[3:9]:
                pending = self._coll_posted.pop(key, None)
                if pending is not None:
                    if pending.nbytes == frame.payload_len and pending.buffer is not None:
                        return pending.buffer, pending
                    self._coll_posted[key] = pending
        return self._coll_header(frame, key)

    def _coll_header(self, frame: Frame, key: CollKey
                     ) -> tuple[memoryview | None, object]:
        n = frame.payload_len
        pending: Pending | None = None
        arrival: _Arrival | None = None
        wrong_size = False
        with self._lock:
            state = self._groups.get(frame.group) or \
                self._groups.setdefault(frame.group, _GroupState())
            fp = state.calls.get(frame.seq)
            bad = fp is not None and fp.differs(frame)
            limit = call_bytes(fp) if fp is not None and not bad else None
            if limit is not None and n > limit:
                too_big = limit
            else:
                too_big = -1
                pending = self._coll_posted.get(key)
                if pending is not None and not bad and pending.nbytes == n:
                    del self._coll_posted[key]
                    assert pending.buffer is not None
                    return pending.buffer, pending
                wrong_size = pending is not None and pending.nbytes != n
                if pending is None and fp is not None and not bad and not n \
                        and key[4] == _CHECK_LANE:
                    # a ring-check frame that matches our call: nothing to deliver, and
                    # a confirmed call never asks for it (see ``take_checks``)
                    state.checked[frame.seq] = frame.src
                    return None, DROP
                if not (bad or wrong_size):
                    # park it, if it fits: nobody has asked for it yet
                    if not self._fits_locked(frame.src, n):
                        self._held.add(frame.src)
                        return None, HOLD
                    if fp is None:
                        state.early.setdefault(frame.seq, []).append(frame)
                    arrival = _Arrival(frame, memoryview(b""))
                    self._park_locked(arrival)
                    # a receive posted while we allocate (unlocked) finds it incomplete
                    # and waits for on_payload
                    self._coll_arrived[key] = arrival
        if too_big >= 0:
            self._protocol_error(frame, (
                f"rank {frame.src} sent a frame of {n} bytes for collective #{frame.seq} of "
                f"group {frame.group}, whose call holds at most {too_big} bytes per frame: "
                f"the peer is corrupt, hostile, or runs a different rankwise"))
        if bad or wrong_size:
            detail = "" if bad or pending is None else (
                f"rank {frame.src} sent {n} bytes where {pending.nbytes} were expected "
                "(uneven split sizes?)")
            self._on_mismatch(frame, fp, detail)
            return None, DROP  # read off the wire and dropped, never allocated
        assert arrival is not None
        arrival.data = self._allocate(frame)
        return arrival.data, arrival

    def _protocol_error(self, frame: Frame, message: str) -> None:
        """A peer broke the protocol: fail everything, and drop its connection."""
        if self._on_protocol_error is not None:
            self._on_protocol_error(frame.src, message)
        else:
            self.fail_all(DistError(message))
        raise WireError(message)

    @staticmethod
    def _allocate(frame: Frame) -> memoryview:
        try:
            return _uninitialized(frame.payload_len)
        except MemoryError:
            raise MemoryError(f"out of memory taking a frame of {frame.payload_len} bytes "
                              f"from rank {frame.src}") from None

    def _p2p_header(self, frame: Frame) -> tuple[memoryview | None, object]:
        n = frame.payload_len
        size_error: DistError | None = None
        failed: Pending | None = None
        arrival: _Arrival | None = None
        with self._lock:
            posted = self._p2p_posted[frame.kind]
            for i, pending in enumerate(posted):
                if (pending.src == -1 or pending.src == frame.src) and pending.tag == frame.tag \
                        and pending.group == frame.group:
                    if pending.nbytes == n:
                        del posted[i]
                        assert pending.buffer is not None
                        return pending.buffer, pending
                    if pending.buffer is None:  # "whatever arrives" (object messages)
                        del posted[i]
                        arrival = _Arrival(frame, memoryview(b""), waiter=pending)
                        self._p2p_arrived[frame.kind].append(arrival)
                        break
                    size_error = DistError(
                        f"recv from rank {frame.src} (tag {frame.tag}) expected "
                        f"{pending.nbytes} bytes but rank {frame.src} sent {n}: "
                        "the tensors passed to send and recv differ in size or dtype"
                    )
                    del posted[i]
                    failed = pending
                    break
            if arrival is None:  # nobody asked for it (or asked with the wrong size): park
                if not self._fits_locked(frame.src, n):
                    self._held.add(frame.src)
                    arrival = None
                else:
                    arrival = _Arrival(frame, memoryview(b""))
                    self._park_locked(arrival)
                    self._p2p_arrived[frame.kind].append(arrival)
        if failed is not None:
            failed.finish(frame, size_error)
        if arrival is None:
            return None, HOLD
        arrival.data = self._allocate(frame)
        return arrival.data, arrival

    # --- parking caps (lock held unless said otherwise) ---------------------------------

    def _fits_locked(self, src: int, n: int) -> bool:
        cost = n + _OVERHEAD
        return (self._parked.get(src, 0) + cost <= self.per_peer_cap
                and self._parked_total + cost <= self.total_cap)

    def _park_locked(self, arrival: _Arrival) -> None:
        cost = arrival.frame.payload_len + _OVERHEAD
        arrival.parked = cost
        src = arrival.frame.src
        self._parked[src] = self._parked.get(src, 0) + cost
        self._parked_total += cost

    def _unpark_locked(self, arrival: _Arrival) -> None:
        cost = arrival.parked
        if cost:  # (clamped: a failure may have reset the counts meanwhile)
            arrival.parked = 0
            src = arrival.frame.src
            left = self._parked.get(src, 0) - cost
            if left > 0:
                self._parked[src] = left
            else:
                self._parked.pop(src, None)
            self._parked_total = max(0, self._parked_total - cost)

    def _take_held(self) -> list[int]:
        """Peers held back, to resume once the lock is released (lock held)."""
        if not self._held:
            return []
        held = list(self._held)
        self._held.clear()
        return held

    def _resume_all(self, held: list[int]) -> None:
        """Let the transport try the held peers' next frames again (lock not held)."""
        resume = self.resume
        if resume is not None:
            for rank in held:
                resume(rank)

    def parked(self) -> dict[str, object]:
        """Statistics: bytes parked per peer and in total, peers held back."""
        with self._lock:
            return {"per_peer": {r: b for r, b in self._parked.items() if b},
                    "total": self._parked_total, "held": sorted(self._held),
                    "per_peer_cap": self.per_peer_cap, "total_cap": self.total_cap}

    def on_payload(self, frame: Frame, token: Pending | _Arrival) -> None:
        """The payload of ``frame`` is now entirely in the buffer ``on_header`` gave."""
        if isinstance(token, Pending):  # it went straight into a posted buffer
            token.finish(frame)
            return
        arrival = token
        with self._lock:
            arrival.complete = True
            waiter = arrival.waiter
            if waiter is not None and frame.kind == Kind.COLL:
                self._coll_arrived.pop(coll_key(frame), None)
            elif waiter is not None:
                try:
                    self._p2p_arrived[frame.kind].remove(arrival)
                except ValueError:
                    pass
        if waiter is not None:
            self._deliver_copy(arrival, waiter)

    def _deliver_copy(self, arrival: _Arrival, pending: Pending) -> None:
        """Hand a parked arrival to its receive, then free its room under the caps."""
        try:
            self._deliver(arrival, pending)
        finally:
            with self._lock:
                self._unpark_locked(arrival)
                held = self._take_held()
            self._resume_all(held)

    def _deliver(self, arrival: _Arrival, pending: Pending) -> None:
        frame = arrival.frame
        if pending.buffer is None:
            pending.buffer = arrival.data
            pending.nbytes = len(arrival.data)
            pending.finish(frame)
            return
        if pending.nbytes != frame.payload_len and frame.kind == Kind.COLL:
            # a collective's sizes disagree: that is a mismatch between the two calls, and
            # the waiter fails with the mismatch (it stays posted until the router fails)
            key = coll_key(frame)
            with self._lock:
                state = self._groups.get(frame.group)
                fp = state.calls.get(frame.seq) if state is not None else None
                if self._failed is None:
                    self._coll_posted[key] = pending
            if self._failed is not None:
                pending.finish(None, self._failed)
            self._on_mismatch(frame, fp, f"rank {frame.src} sent {frame.payload_len} bytes "
                              f"where {pending.nbytes} were expected (uneven split sizes?)")
            return
        if pending.nbytes != frame.payload_len:
            pending.finish(frame, DistError(
                f"message from rank {frame.src} has {frame.payload_len} bytes but the "
                f"receiving buffer has {pending.nbytes}: sizes or dtypes differ between ranks"
            ))
            return
        pending.buffer[:] = arrival.data
        pending.finish(frame)

    # --- failures --------------------------------------------------------------------

    def fail_all(self, exc: BaseException) -> None:
        """Poison the router: every waiter and every later post raises ``exc``."""
        with self._lock:
            first = self._failed is None
            if first:
                # raised again from every wait of every thread: whatever exception one of
                # them happened to be handling is not its context (a job-wide DeadlockError
                # printed under a "PeerFailure ... during handling" header misleads)
                exc.__suppress_context__ = True
                self._failed = exc
            self._news.notify_all()
            waiters = list(self._coll_posted.values())
            self._coll_posted.clear()
            for lst in self._p2p_posted.values():
                waiters.extend(lst)
                lst.clear()
            for arrival in self._coll_arrived.values():
                if arrival.waiter is not None:
                    waiters.append(arrival.waiter)
            # nothing parked will be delivered now: free it, and read the held peers
            # again (their aborts and goodbyes explain the failure)
            for arrival in self._coll_arrived.values():
                arrival.parked = 0
            self._coll_arrived.clear()
            for queue in self._p2p_arrived.values():
                for arrival in queue:
                    arrival.parked = 0
                    if arrival.waiter is not None:
                        waiters.append(arrival.waiter)
                queue.clear()
            self._parked.clear()
            self._parked_total = 0
            held = self._take_held()
        for p in waiters:
            p.finish(None, self._failed)
        self._resume_all(held)
        if first:
            for listener in list(self.on_failure):
                listener(exc)

    def fail_peer(self, rank: int, exc: BaseException) -> None:
        """``rank`` is gone: fail the receives that can only be satisfied by it."""
        with self._lock:
            self._gone.setdefault(rank, exc)
            self._news.notify_all()
            doomed = [k for k, p in self._coll_posted.items() if k[2] == rank]
            waiters = [self._coll_posted.pop(k) for k in doomed]
            for lst in self._p2p_posted.values():
                for p in [p for p in lst if p.src == rank]:
                    lst.remove(p)
                    waiters.append(p)
        for p in waiters:
            p.finish(None, exc)
