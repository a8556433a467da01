"""A group's book of device works in flight (``WorkBook``), which the process's one
ledger thread watches (``core.ledger``): bounded collectives without a host sync per call.

Why: a wait that blocks the calling thread until the kernel has finished stops the CPU
from running ahead of the GPU (kernel launch latency is no longer hidden, DDP's overlap
of gradient all-reduce with backward changes). torch keeps ``wait()`` to "the current
stream waits for the collective" and bounds it with a watchdog thread that looks at each
work's CUDA event; rankwise does the same, at torch's cost per call: ``watch`` appends a
record (``Pending``) to the group's book and wakes nobody, and the process's one ledger
thread (``core.ledger``) passes over the book only when a record needs it: its grace
period ran out (the ring check's batch is sent then: a mismatch that hangs NCCL is found),
its slow-call or deadlock-probe time, its deadline (abort), a future waiting for its
kernels, or a failure the port pushed (``kick``). Only then are works' events queried
(``work.is_completed()``: never a timed ``wait``, which NCCL turns into a process
teardown). Past a call's deadline, or on a control-plane failure, it aborts the
communicator (which ends kernels waiting for peers) and settles every work in flight
with the error; the error stays (``failed``) and is raised by the next call on the
group and by ``Work.wait()``.

Testable in-process: the clock, the abort and the control plane (``Plane``) are passed
in, and ``tick`` is one pass a test calls itself (no thread, no sleeps).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...slots import fast_new
from .failures import TORCH_ERRORS

if TYPE_CHECKING:
    from ...core.ledger import Ledger
    from ..base import Call

__all__ = ["GRACE", "HEARTBEAT", "POLL", "Pending", "Plane", "WorkBook", "new_pending"]

log = logging.getLogger("rankwise")

#: seconds a work may run before the plane's ``slow`` runs once for it (it sends the
#: ring check's batched fingerprints: a mismatch that hangs the data plane is found then);
#: the host wait's ``on_slow`` too (``host_wait.WorkWaiter``)
GRACE = 0.005
#: seconds between passes while a future waits for a work's kernels (its callbacks, DDP's
#: communication hooks, run when the pass sees the work done), or the check was busy
POLL = 0.001
#: seconds between passes at most while works are in flight (torch's watchdog: 0.1 s):
#: finished records are dropped then (they hold the works, and the works the tensors)
HEARTBEAT = 0.1


class Plane(Protocol):
    """What the book asks rankwise's control plane (``device_waits.CommPlane``)."""

    def failure(self) -> BaseException | None:
        """The job's failure known by now (as this rank should raise it), or None."""

    def slow(self, call: Call) -> bool:
        """``call``'s work has run ``GRACE`` s: send what it may be waiting for (False:
        not now, ask again on the next pass)."""

    def warn_at(self, call: Call, start: float) -> float:
        """When (the book's clock) to log who-is-where for a call begun at ``start``."""

    def warn(self, call: Call) -> None:
        """Log who-is-where (the call is slow)."""

    def probe_at(self, start: float) -> float:
        """When to ask first whether the job is stuck for good."""

    def probe(self, blocked_for: float) -> float:
        """Ask whether the job is stuck for good; seconds until the next ask."""

    def timed_out(self, call: Call) -> BaseException:
        """The error for ``call`` past its deadline (with the who-is-where table)."""

    def op_failed(self, call: Call, err: BaseException) -> BaseException:
        """The error for ``call`` whose torch op itself failed."""


class _Settled:
    """``Pending.settled`` as an event (``is_set``, a bounded ``wait``) for the few who
    block on one (the host stand-in, ``drain``, tests); a record itself holds no lock."""

    __slots__ = ("_p",)

    def __init__(self, p: Pending) -> None:
        self._p = p

    def is_set(self) -> bool:
        return self._p.is_settled

    def wait(self, timeout: float | None = None) -> bool:
        end = math.inf if timeout is None else time.monotonic() + timeout
        delay = 20e-6
        while not self._p.is_settled:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.005)
        return True


@dataclass(slots=True, eq=False, repr=False)
class Pending:
    """One torch work in flight (a record of the book), until settled: done, or an
    error. Made by the caller with no lock and no event (``watch``: without the Python
    ``__init__``, ``rankwise.slots``)."""

    book: WorkBook
    call: Call
    work: Any
    start: float
    #: the work finishes after every earlier ordered record's (``WorkBook.watch``)
    ordered: bool = False
    slowed: bool = False
    warn_at: float = math.nan  #: set on the first pass that finds it running
    probe_at: float = math.nan
    error: BaseException | None = None
    is_settled: bool = False
    _callbacks: list[Callable[[Pending], None]] | None = None
    #: a split host call's (``host_async``): its write-back, run when the op ends, and
    #: whether gloo's callback or a waiter has begun finishing it
    post: Callable[[], object] | None = None
    claimed: bool = False

    @property
    def settled(self) -> _Settled:
        return _Settled(self)

    def done(self) -> bool:
        """Settled, or the kernel is done (asked directly: an event query, so
        ``is_completed`` never lags the ledger's pass)."""
        if self.is_settled:
            return True
        if self.post is not None:  # its write-back runs when it settles: not done before
            return False
        try:
            return bool(self.work.is_completed())
        except TORCH_ERRORS:
            return True  # the op failed: done, its error comes with ``wait``

    # --- the device side of an async ``Work`` with one torch work (``core.work``) ------

    def wait(self) -> None:
        """The waiter's stream is ordered after this work (its book's ``order``: the
        engine's stream order); the book's verdict known by now is raised."""
        self.book.order(self.call, self)

    def when_done(self, fn: Callable[[BaseException | None], None]) -> None:
        """``fn(error)`` once settled (on the ledger's thread, or here if it is)."""
        self.on_settled(lambda p: fn(p.error))

    def on_settled(self, fn: Callable[[Pending], None]) -> None:
        """Run ``fn(self)`` once the record is settled (at once if it is); the book is
        passed over every ``POLL`` s until then."""
        book = self.book
        with book.lock:
            if not self.is_settled:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                book.waited += 1
                fn = None  # type: ignore[assignment]
        if fn is not None:
            fn(self)
            return
        if not book.pushed:
            book.kick(POLL)

    def settle(self, error: BaseException | None) -> None:
        self.book.settle((self,), error)

    def _fire(self, callbacks: list[Callable[[Pending], None]]) -> None:
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # the ledger's pass outlives a bad callback
                log.exception("rankwise: a callback of %s failed", self.call.describe())


#: ``Pending(book, call, work, start, ordered)`` without its Python ``__init__``
new_pending = fast_new(Pending)


def _no_order(call: Call, p: Pending) -> None:
    raise RuntimeError(f"{call.describe()}: its book has no stream order to wait with")


class WorkBook:
    """One torch group's book of works in flight (a ``core.ledger.Book``: the ledger's
    thread passes over it); aborts the group past a deadline or on a control-plane
    failure. ``clock``: seconds, monotonic (``call.deadline``'s clock);
    ``abort``: ends the group's kernels (``ProcessGroupNCCL.abort``), called once;
    ``ledger``: whose thread passes over the book (the process's by default);
    ``pushed``: each work settles its own record when it ends (gloo's future,
    ``host_async``), so a waited-for record needs no pass every ``POLL`` s."""

    def __init__(self, plane: Plane, abort: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "nccl",
                 on: Ledger | None = None, pushed: bool = False) -> None:
        self.plane = plane
        self.pushed = pushed
        self._abort = abort
        self.clock = clock
        self.name = name
        #: the book: its records in the order they were appended
        self.records: deque[Pending] = deque()
        #: guards settling and callbacks (the caller never takes it on the fast path)
        self.lock = threading.Lock()
        self._ledger = on
        self._started = False
        #: when (``clock``) this book needs its next pass; a record due sooner kicks
        self.due_at = math.inf
        #: records a future waits for (their book is passed over every ``POLL`` s)
        self.waited = 0
        #: the first error that aborted the group: every later call raises it
        self.failed: BaseException | None = None
        #: ``order(call, p)``: what runs next on this thread sees ``p``'s result (the
        #: engine's ``DeviceWaits.order``; ``Pending.wait``)
        self.order: Callable[[Call, Pending], None] = _no_order
        self.aborted = False

    # --- the caller's side ---------------------------------------------------------

    def watch(self, call: Call, work: Any, ordered: bool = False) -> Pending:
        """Record ``work`` (just enqueued for ``call``); returns its record. Appends,
        and wakes the ledger only when nothing earlier is due. ``ordered``: the work
        runs after every earlier ordered one (one NCCL communicator's collectives share
        its stream), so a pass queries a few of them, not each (``_ordered_bounds``)."""
        start = self.clock()
        p = new_pending(self, call, work, start, ordered)
        self.records.append(p)
        if self.failed is not None or start + GRACE < self.due_at:
            self.appended(p, start)
        return p

    def appended(self, p: Pending, start: float) -> None:
        """``watch``'s tail where it has anything to do (the device engine's hot path
        writes out the rest): a record appended to a failed book is settled at once
        (``failed`` read after the append: ``fail`` misses none); the first one due
        before anything else asks the ledger for a pass."""
        if self.failed is not None:
            p.settle(self.failed)
        elif start + GRACE < self.due_at and self._started:
            self.due_at = start + GRACE
            self.kick(GRACE)

    def kick(self, delay: float = 0.0) -> None:
        """Ask for a pass within ``delay`` seconds (a pushed failure: at once)."""
        on = self._ledger
        if self._started and on is not None:
            on.kick(delay)

    def in_flight(self) -> int:
        return sum(not p.is_settled for p in list(self.records))

    def drain(self, timeout: float) -> bool:
        """Wait (the host, bounded) until every work in flight is settled: a group
        being destroyed. True if none is left."""
        end = self.clock() + timeout
        self.kick(0.0)
        for p in list(self.records):
            while not p.is_settled:
                if p.done():
                    p.settle(None)
                    break
                if self.clock() >= end:
                    return False
                p.settled.wait(0.005)
        return True

    def start(self) -> None:
        """Have the ledger's thread pass over this book when it is due."""
        if not self._started:
            from ...core.ledger import ledger  # engines import no core module at load

            self._ledger = self._ledger or ledger()
            self._started = True
            self._ledger.register(self)
            if self.records:
                self.kick(0.0)

    def stop(self, timeout: float = 1.0) -> None:
        if self._started and self._ledger is not None:
            self._ledger.unregister(self)
        self._started = False

    # --- the ledger's side ---------------------------------------------------------

    def tick(self) -> None:
        """One pass (tests call it directly)."""
        self.pass_due()

    def pass_due(self) -> float:
        """Settle finished works; on a control-plane failure or a work past its
        deadline, abort the group and settle every work with the error. Returns the
        seconds until the next pass is due (``math.inf``: none in flight)."""
        self.due_at = math.inf  # from here a new record kicks: none is missed
        records = list(self.records)
        if not records:
            return math.inf
        plane = self.plane
        failure = plane.failure()
        if failure is not None:
            self.fail(failure)
            return math.inf
        now = self.clock()
        due = math.inf
        front = 0  #: settled records at the front: dropped
        running = False
        finished: list[Pending] = []  #: done, settled together (one lock, not one each)
        done_below, running_from = _ordered_bounds(records)
        for i, p in enumerate(records):
            if not p.is_settled:
                if i < done_below and p.ordered:  # known done from its stream's order
                    finished.append(p)  # (the common case first: ~0.4 us less a record)
                    if not running:
                        front += 1
                    continue
                try:
                    done = (not p.ordered or i < running_from) and p.work.is_completed()
                except TORCH_ERRORS as err:
                    self.settle(finished)
                    self.fail(plane.op_failed(p.call, err))
                    return math.inf
                if done:
                    finished.append(p)
                else:
                    if finished:  # before anything here may fail the rest
                        self.settle(finished)
                        finished = []
                    due = min(due, self._running(p, now))
                    if self.failed is not None:
                        return math.inf
                    running = True
            if not running:
                front += 1
        if finished:
            self.settle(finished)
        for _ in range(front):
            self.records.popleft()
        if running:
            due = min(due, now + (POLL if self.waited and not self.pushed else HEARTBEAT))
        if len(self.records) > len(records) - front:  # appended during the pass
            due = min(due, now + GRACE)
        self.due_at = due
        return max(0.0, due - now)

    def settle(self, records: Sequence[Pending], error: BaseException | None = None) -> None:
        """Settle ``records`` (those not settled yet) with ``error``, under one taking of
        the lock, then run their callbacks: a pass settles hundreds at once, so the loop
        is written out (a method call per record cost ~0.1 us of the ledger's CPU)."""
        fire = []
        with self.lock:
            for p in records:
                if not p.is_settled:
                    p.error = error
                    p.is_settled = True
                    callbacks = p._callbacks
                    if callbacks:
                        p._callbacks = None
                        self.waited -= 1
                        fire.append((p, callbacks))
        for p, cbs in fire:
            p._fire(cbs)

    def _running(self, p: Pending, now: float) -> float:
        """A work still running at ``now``: its deadline, grace and slow-call hooks;
        when it needs the next pass."""
        plane = self.plane
        call = p.call
        if now >= call.deadline:
            self.fail(plane.timed_out(call))
            return now
        if math.isnan(p.warn_at):
            p.warn_at = plane.warn_at(call, p.start)
            p.probe_at = plane.probe_at(p.start)
        due = min(call.deadline, p.warn_at, p.probe_at)
        if not p.slowed:
            if now - p.start >= GRACE:
                p.slowed = plane.slow(call)
                if not p.slowed:
                    due = min(due, now + POLL)
            else:
                due = min(due, p.start + GRACE)
        if now >= p.warn_at:
            p.warn_at = math.inf
            plane.warn(call)
        if now >= p.probe_at:
            p.probe_at = now + plane.probe(now - p.start)
            due = min(due, p.probe_at)
        return due

    def fail(self, error: BaseException) -> None:
        """Abort the group (once) and settle every work in flight with ``error``."""
        with self.lock:
            if self.failed is None:
                self.failed = error
            error = self.failed
            abort = not self.aborted
            self.aborted = True
        records = list(self.records)  # a record appended later settles itself (watch)
        for _ in records:
            self.records.popleft()
        if abort:
            log.debug("rankwise: %s book aborts the group: %s", self.name, error)
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001 - the group is given up anyway
                log.debug("rankwise: %s abort: %r", self.name, exc)
        for p in records:
            p.settle(error)


def _ordered_bounds(records: list[Pending]) -> tuple[int, int]:
    """``(done_below, running_from)``: the ordered records at indexes below the first are
    done, those from the second on are still running; the rest are asked one by one.
    Ordered works finish in order (one stream), so a binary search over their
    ``is_completed``, newest first (mostly all done: one query), finds the boundary:
    a pass asks a few events instead of one per call (~1 us of the ledger's CPU each).
    NCCL's ``isCompleted`` also reports the communicator's error, shared by its works:
    a done newest work vouches for the earlier ones. A query that raises is left to the
    pass, which asks that record itself and fails the group."""
    at = [i for i, p in enumerate(records) if p.ordered and not p.is_settled]
    lo, hi = 0, len(at)  #: at[:lo] done, at[hi:] running
    try:
        if hi and records[at[-1]].work.is_completed():
            lo = hi
        else:
            hi -= 1 if hi else 0
            while lo < hi:
                mid = (lo + hi) // 2
                if records[at[mid]].work.is_completed():
                    lo = mid + 1
                else:
                    hi = mid
    except TORCH_ERRORS:
        pass
    done_below = at[lo - 1] + 1 if lo else 0
    running_from = at[hi] if hi < len(at) else len(records)
    return done_below, running_from
