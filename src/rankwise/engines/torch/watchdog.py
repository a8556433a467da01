"""The NCCL engine's watchdog: bounded collectives without a host sync per call.

Why: a wait that blocks the calling thread until the kernel has finished stops the CPU
from running ahead of the GPU (kernel launch latency is no longer hidden, DDP's overlap
of gradient all-reduce with backward changes). torch keeps ``wait()`` to "the current
stream waits for the collective" and bounds it with a watchdog thread that polls each
work's CUDA event; rankwise does the same. Each torch work in flight is ``watch``-ed:
one thread polls its completion (``work.is_completed()``: a CUDA event query, never a
timed ``wait``, which NCCL turns into a process teardown) and the control plane (a
mismatch found by the ring check, a dead or failed peer, a deadlock probe). Past a
call's deadline, or on a control-plane failure, it aborts the communicator (which ends
kernels waiting for peers) and settles every work in flight with the error; the error
stays (``failed``) and is raised by the next call on the group and by ``Work.wait()``.

Testable in-process: the clock, the abort and the control plane (``Plane``) are passed
in, and ``tick`` is one pass a test calls itself (no thread, no sleeps).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..base import Call

__all__ = ["GRACE", "POLL", "Pending", "Plane", "Watchdog"]

log = logging.getLogger("rankwise")

#: seconds a work may run before the plane's ``slow`` runs once for it (it sends the
#: ring check's batched fingerprints: a mismatch that hangs the data plane is found then)
GRACE = 0.005
#: seconds between two passes while works are in flight (torch's own watchdog: 0.1 s;
#: shorter here because completions also complete ``Work`` futures, whose callbacks
#: (DDP's communication hooks) wait for the pass; an event query costs microseconds)
POLL = 0.001
#: seconds between passes at most (the poll backs off while the same works stay in flight)
POLL_MAX = 0.005


class Plane(Protocol):
    """What the watchdog asks rankwise's control plane (``wait.CommPlane``)."""

    def failure(self) -> BaseException | None:
        """The job's failure known by now (as this rank should raise it), or None."""

    def slow(self, call: Call) -> bool:
        """``call``'s work has run ``GRACE`` s: send what it may be waiting for (False:
        not now, ask again on the next pass)."""

    def warn_at(self, call: Call, start: float) -> float:
        """When (watchdog clock) to log who-is-where for a call begun at ``start``."""

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


class Pending:
    """One torch work in flight, until the watchdog settles it (done, or an error)."""

    __slots__ = (
        "_callbacks",
        "_lock",
        "call",
        "error",
        "probe_at",
        "settled",
        "slowed",
        "start",
        "warn_at",
        "work",
    )

    def __init__(self, call: Call, work: Any, start: float, plane: Plane) -> None:
        self.call = call
        self.work = work
        self.start = start
        self.slowed = False
        self.warn_at = plane.warn_at(call, start)
        self.probe_at = plane.probe_at(start)
        self.error: BaseException | None = None
        self.settled = threading.Event()
        self._callbacks: list[Callable[[Pending], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Settled by the watchdog, or the kernel is done (asked directly: a CUDA event
        query, so ``is_completed`` never lags the watchdog's poll)."""
        if self.settled.is_set():
            return True
        try:
            return bool(self.work.is_completed())
        except RuntimeError:
            return True  # the op failed: done, its error comes with ``wait``

    def on_settled(self, fn: Callable[[Pending], None]) -> None:
        """Run ``fn(self)`` once the watchdog settles this work (at once if it has)."""
        with self._lock:
            if not self.settled.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def settle(self, error: BaseException | None) -> None:
        with self._lock:
            if self.settled.is_set():
                return
            self.error = error
            self.settled.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # the watchdog outlives a bad pass or callback
                log.exception("rankwise: a callback of %s failed", self.call.describe())


class Watchdog:
    """Polls the works of one torch group; aborts the group past a deadline or on a
    control-plane failure. ``clock``: seconds, monotonic (``call.deadline``'s clock);
    ``abort``: ends the group's kernels (``ProcessGroupNCCL.abort``), called once."""

    def __init__(self, plane: Plane, abort: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "nccl") -> None:
        self.plane = plane
        self._abort = abort
        self.clock = clock
        self.name = name
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: the first error that aborted the group: every later call raises it
        self.failed: BaseException | None = None
        self.aborted = False

    # --- the caller's side ---------------------------------------------------------

    def watch(self, call: Call, work: Any) -> Pending:
        """Start watching ``work`` (just enqueued for ``call``); returns its handle."""
        p = Pending(call, work, self.clock(), self.plane)
        with self._lock:
            failed = self.failed
            if failed is None:
                self._pending.append(p)
                self._wake.notify()
        if failed is not None:
            p.settle(failed)
        return p

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def drain(self, timeout: float) -> bool:
        """Wait (the host, bounded) until every work in flight is settled: a group
        being destroyed. True if none is left."""
        end = self.clock() + timeout
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            if not p.settled.wait(max(0.0, end - self.clock())):
                return False
        return True

    def start(self) -> None:
        """Run ``tick`` on a daemon thread while works are in flight."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"rankwise-{self.name}-"
                                            "watchdog", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- the watchdog's side -------------------------------------------------------

    def _loop(self) -> None:
        delay = POLL
        while True:
            with self._lock:
                while not self._pending and not self._stopped:
                    self._wake.wait()
                    delay = POLL
                if self._stopped:
                    return
                before = len(self._pending)
            try:
                self.tick()
            except Exception:  # the watchdog outlives a bad pass or callback
                log.exception("rankwise: %s watchdog pass failed", self.name)
            with self._lock:
                after = len(self._pending)
                if self._stopped:
                    return
                if after:  # back off while the same works stay in flight
                    delay = POLL if after < before else min(delay * 2, POLL_MAX)
                    self._wake.wait(delay)

    def tick(self) -> None:
        """One pass: settle finished works; on a control-plane failure or a work past
        its deadline, abort the group and settle every work with the error."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return
        plane = self.plane
        failure = plane.failure()
        if failure is not None:
            self.fail(failure)
            return
        now = self.clock()
        finished = []
        for p in pending:
            try:
                done = bool(p.work.is_completed())
            except RuntimeError as err:
                self.fail(plane.op_failed(p.call, err))
                return
            if done:
                finished.append(p)
                continue
            if now >= p.call.deadline:
                self.fail(plane.timed_out(p.call))
                return
            if not p.slowed and now - p.start >= GRACE:
                p.slowed = plane.slow(p.call)
            if now >= p.warn_at:
                p.warn_at = float("inf")
                plane.warn(p.call)
            if now >= p.probe_at:
                p.probe_at = now + plane.probe(now - p.start)
        if finished:
            with self._lock:
                gone = set(map(id, finished))
                self._pending = [p for p in self._pending if id(p) not in gone]
            for p in finished:
                p.settle(None)

    def fail(self, error: BaseException) -> None:
        """Abort the group (once) and settle every work in flight with ``error``."""
        with self._lock:
            if self.failed is None:
                self.failed = error
            error = self.failed
            pending, self._pending = self._pending, []
            abort = not self.aborted
            self.aborted = True
        if abort:
            log.debug("rankwise: %s watchdog aborts the group: %s", self.name, error)
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001 - the group is given up anyway
                log.debug("rankwise: %s abort: %r", self.name, exc)
        for p in pending:
            p.settle(error)
