"""Matching arriving frames to the receives ranks have posted: collectives by (group, seq,
src, step, lane), p2p and library objects by (src, tag) in arrival order. Every frame is
checked against this rank's call before its payload is used; what nobody asked for yet is
parked within caps (``core.parking``). Rationale: docs/design.md, "Router".
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ..errors import DistError
from ..identity.calls import Fingerprint
from ..wire.frames import DROP, HOLD, LANE_FLAGS, Frame, Kind, WireError
from .check_batches import CheckBatches
from .mailbox import (
    CHECK_LANE,
    Arrival,
    CollKey,
    GroupState,
    Pending,
    call_bytes,
    coll_key,
    uninitialized,
)
from .parking import Parking

__all__ = ["CollKey", "Pending", "Router", "coll_key"]

#: called as (frame, our fingerprint or None, extra detail) when a frame contradicts our call
MismatchHandler = Callable[[Frame, "Fingerprint | None", str], None]
#: called as (sender's global rank, message) when a peer breaks the protocol
ProtocolErrorHandler = Callable[[int, str], None]


#: calls between two trims of a group's per-call records (``register_call``)
_TRIM = 64


def _trim(state: GroupState, below: int) -> None:
    """Drop ``state``'s per-call records of calls before #``below`` (bounded memory: a
    neighbour is never that far behind)."""
    start = state.trimmed
    if below <= start:
        return
    for book in (state.calls, state.wire, state.checked, state.expected):
        if book:
            pop = book.pop
            for seq in range(start, below):
                pop(seq, None)
    state.trimmed = below


class Router(Parking):
    """Thread-safe mailboxes shared by the I/O thread (producer) and callers (consumers)."""

    def __init__(self, on_mismatch: MismatchHandler,
                 on_protocol_error: ProtocolErrorHandler | None = None,
                 per_peer: int | None = None, total: int | None = None) -> None:
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  #: a failure or a departure was noted
        self._on_mismatch = on_mismatch
        self._on_protocol_error = on_protocol_error
        Parking.__init__(self, per_peer, total)
        self._coll_posted: dict[CollKey, Pending] = {}
        self._coll_arrived: dict[CollKey, Arrival] = {}
        self._p2p_posted: dict[int, list[Pending]] = {Kind.P2P: [], Kind.OBJ: []}
        self._p2p_arrived: dict[int, deque[Arrival]] = {Kind.P2P: deque(), Kind.OBJ: deque()}
        self._groups: dict[int, GroupState] = {}
        #: the first failure (set once, under the lock); a plain attribute, not a property:
        #: every call reads it two or three times
        self.failure: BaseException | None = None
        self._gone: dict[int, BaseException] = {}  #: peers that left or died
        #: told (once, outside the lock) of the first failure: engines whose data plane
        #: rankwise does not own (a torch group) abort it so no rank stays blocked there
        self.on_failure: list[Callable[[BaseException], None]] = []
        #: the ring check's batched fingerprints (torch engines only, ``core.check_batches``)
        self.checks = CheckBatches(self._lock, self._groups, self._coll_posted)

    # --- state shared with callers ---------------------------------------------------

    def peer_gone(self, rank: int) -> BaseException | None:
        return self._gone.get(rank)

    def wait_for_cause(self, rank: int, timeout: float) -> BaseException | None:
        """Block (at most ``timeout``) until the reader has noted why the connection to
        ``rank`` broke: what the peer sent before it closed (an abort it relays, its
        goodbye) names the real cause better than the broken pipe does."""
        with self._news:
            self._news.wait_for(lambda: self.failure is not None or rank in self._gone,
                                timeout)
            return self.failure or self._gone.get(rank)

    def wait_for_any_cause(self, ranks: list[int], timeout: float) -> BaseException | None:
        """Like ``wait_for_cause``, for whichever of ``ranks`` is noted gone first (or a
        failure of the whole job): what explains a foreign engine's broken op."""
        def cause() -> BaseException | None:  # the first to go (dicts keep order)
            return self.failure or next((exc for r, exc in self._gone.items() if r in ranks),
                                        None)
        with self._news:
            self._news.wait_for(lambda: cause() is not None, timeout)
            return cause()

    def register_call(self, group: int, seq: int, fp: Fingerprint, keep: int = 1024) -> None:
        """Record this rank's call #seq; check frames that arrived before it was made."""
        with self._lock:
            # (not ``setdefault(group, GroupState())``: that built a state, four dicts,
            # on every call only to throw it away)
            state = self._groups.get(group) or self._groups.setdefault(group, GroupState())
            state.calls[seq] = fp
            state.last = seq
            if fp.count != -1:
                state.wire[seq] = fp  # its fields in a header's order
            if not seq % _TRIM:  # what is ``keep`` calls old goes, ``_TRIM`` at a time
                _trim(state, seq - keep)
            bad: list[Frame] = []
            if state.early_checks:
                f = state.early_checks.pop(seq, None)
                if f is not None:  # the neighbour's entry came first (``CheckBatches``)
                    if fp.differs(f):
                        bad.append(f)
                    else:
                        state.checked[seq] = f.src
            for f in state.early.pop(seq, ()) if state.early else ():
                if fp.differs(f):  # parked before we made the call: never deliver it
                    bad.append(f)
                    gone = self._coll_arrived.pop(coll_key(f), None)
                    if gone is not None:
                        self._unpark_locked(gone)
                elif f.flags & LANE_FLAGS == CHECK_LANE and not f.payload_len:
                    # a ring-check frame judged good now: a confirmed call never takes it
                    # (``take_checks``), so it leaves the parked frames for ``checked``
                    key = coll_key(f)
                    arrival = self._coll_arrived.get(key)
                    if arrival is not None and arrival.complete and arrival.waiter is None:
                        del self._coll_arrived[key]
                        self._unpark_locked(arrival)
                        state.checked[seq] = f.src
            held = self._take_held() if self._held else None
        for frame in bad:
            self._on_mismatch(frame, fp, "")
        if held:
            self._resume_all(held)  # a held frame of this call can now be judged against it

    def check_alive(self, peers: list[int] | range | None = None) -> None:
        """Raise the failure that makes communication pointless, if there is one."""
        if self.failure is not None:
            raise self.failure
        if peers is not None and self._gone:
            for p in peers:
                exc = self._gone.get(p)
                if exc is not None:
                    raise exc

    # --- posting receives (caller threads) -------------------------------------------

    def post_coll(self, key: CollKey, buffer: memoryview) -> Pending:
        pending = Pending(buffer, key[2])
        copy_from: Arrival | None = None
        with self._lock:
            if self.failure is not None:
                pending.finish(None, self.failure)
                return pending
            gone = self._gone.get(key[2])
            arrival = self._coll_arrived.pop(key, None)
            held = self._take_held()
            judged = self.checks.judged_locked(key) if arrival is None and key[4] else None
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

    def _match_p2p_locked(self, kind: int, pending: Pending) -> Arrival | None:
        """Post ``pending`` (lock held); the complete arrival to copy from, if one matched."""
        if self.failure is not None:
            pending.finish(None, self.failure)
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
        arrival: Arrival | None = None
        wrong_size = False
        with self._lock:
            state = self._groups.get(frame.group) or \
                self._groups.setdefault(frame.group, GroupState())
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
                        and key[4] == CHECK_LANE:
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
                    arrival = Arrival(frame, memoryview(b""))
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
            return uninitialized(frame.payload_len)
        except MemoryError:
            raise MemoryError(f"out of memory taking a frame of {frame.payload_len} bytes "
                              f"from rank {frame.src}") from None

    def _p2p_header(self, frame: Frame) -> tuple[memoryview | None, object]:
        n = frame.payload_len
        size_error: DistError | None = None
        failed: Pending | None = None
        arrival: Arrival | None = None
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
                        arrival = Arrival(frame, memoryview(b""), waiter=pending)
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
                    arrival = Arrival(frame, memoryview(b""))
                    self._park_locked(arrival)
                    self._p2p_arrived[frame.kind].append(arrival)
        if failed is not None:
            failed.finish(frame, size_error)
        if arrival is None:
            return None, HOLD
        arrival.data = self._allocate(frame)
        return arrival.data, arrival

    def on_payload(self, frame: Frame, token: Pending | Arrival) -> None:
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

    def _deliver_copy(self, arrival: Arrival, pending: Pending) -> None:
        """Hand a parked arrival to its receive, then free its room under the caps."""
        try:
            self._deliver(arrival, pending)
        finally:
            with self._lock:
                self._unpark_locked(arrival)
                held = self._take_held()
            self._resume_all(held)

    def _deliver(self, arrival: Arrival, pending: Pending) -> None:
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
                if self.failure is None:
                    self._coll_posted[key] = pending
            if self.failure is not None:
                pending.finish(None, self.failure)
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
            first = self.failure is None
            if first:
                # raised again from every wait of every thread: whatever exception one of
                # them happened to be handling is not its context (a job-wide DeadlockError
                # printed under a "PeerFailure ... during handling" header misleads)
                exc.__suppress_context__ = True
                self.failure = exc
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
            p.finish(None, self.failure)
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
