"""Who looks for deadlocks, and when: one prober per job, told by the waiting ranks.

Why: when every waiting rank looked for itself (asking all N ranks where they are), one
wave of waits cost N^2 answers, and at 256 ranks the answers alone kept a slow job from
finishing (docs/scale.md). Now only the lowest-numbered live rank, the job's *prober*,
looks. Every other rank whose wait has lasted ``after`` s sends it a header-only
``BLOCKED`` note naming its call (the call's start time), again on its wait's doubling
back-off (so a new prober hears of it too); nothing on the fast path. The prober looks
when every live rank, itself included, is in its book as blocked in a call no look has
since shown it leave, and some note is new; and on its own wait's doubling back-off (1,
2, 4 ... s, then every ``MAX_BACKOFF``), for waits that never note (a device recv waiting
for its header) and which a look enters in the book. So a wave costs N-1 notes, and a
look N-1 answers, a few per long wait of the prober.

Nothing is lost by asking one rank: a deadlock needs every live rank blocked, the prober
too, so a prober that computes cannot miss one. A prober that dies fails the job
(failure detection); one that leaves cleanly hands over to the next lowest live rank.
The verdict is ``checks.deadlock``'s: two agreeing looks, every live rank answered.
``RANKWISE_DEADLOCK=0`` turns the check off.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .. import settings
from ..errors import DeadlockError, DistError
from ..wire.frames import Kind, encode_header
from .deadlock import CONFIRM_GAP, find_deadlock, snapshot
from .report import stalled_mismatch

if TYPE_CHECKING:
    from ..core.communicator import Communicator

__all__ = ["MAX_BACKOFF", "POLL", "DeadlockWatch", "Notes", "call_id"]

log = logging.getLogger("rankwise")

MAX_BACKOFF = 30.0  #: the longest pause between two notes of one wait, or two of its looks
POLL = 0.2  #: seconds between the prober's glances at its notes while it waits (no I/O)

Report = dict[str, Any]


def call_id(since: Any) -> int:
    """A call's identity on the wire: its start time (``Activity.since``) in µs."""
    try:
        return round(float(since) * 1e6)
    except (TypeError, ValueError, OverflowError):
        return -1


class Notes:
    """The prober's book: the call each rank is blocked in (``call_id``), as it said.

    A look corrects the book: it forgets the ranks it shows outside a call (they moved
    on: their next long wait notes again) and enters those it shows blocked (their wait
    may never note), as old news; a note that arrives while a look runs is kept for the
    next, so no look can swallow the note of the last rank to block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[int, int]] = {}  #: rank -> (call, note number)
        self._count = 0

    def note(self, rank: int, call: int) -> None:
        """``rank`` has waited ``after`` s in ``call`` (the same call again is no news)."""
        with self._lock:
            old = self._calls.get(rank)
            if old is None or old[0] != call:
                self._count += 1
                self._calls[rank] = (call, self._count)

    def mark(self) -> int:
        """The note number a look starts at (for ``seen``)."""
        with self._lock:
            return self._count

    def due(self, live: Iterable[int], mark: int) -> bool:
        """Every rank of ``live`` noted a call, and some note is newer than ``mark``."""
        with self._lock:
            calls = self._calls
            return all(r in calls for r in live) and any(n > mark for _, n in calls.values())

    def seen(self, reports: dict[int, Report], mark: int) -> None:
        """A look that began at ``mark`` saw ``reports``: the book says what it showed,
        except for notes newer than the look (a look's entries are no news)."""
        with self._lock:
            for rank, rep in reports.items():
                old = self._calls.get(rank)
                if old is not None and old[1] > mark:
                    continue
                blocked = rep.get("blocked")
                if rep.get("op") and isinstance(blocked, dict) and not rep.get("gone"):
                    call = call_id(blocked.get("since"))
                    if old is None or old[0] != call:
                        self._calls[rank] = (call, 0)
                elif old is not None:
                    del self._calls[rank]


def _env_after() -> float:
    if not settings.flag("RANKWISE_DEADLOCK"):
        return math.inf
    return settings.number("RANKWISE_DEADLOCK_AFTER")


class DeadlockWatch:
    """One per communicator: notes the prober, or (on the prober) looks, on behalf of
    waits that have lasted ``after`` s."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        #: seconds a wait lasts before it notes the prober (inf: detection off)
        self.after = _env_after()
        self.notes = Notes()
        self._lock = threading.Lock()  #: one look at a time
        self._seen = 0  #: the note number the last conclusive look began at
        self._retry_at = 0.0  #: after an inconclusive look: not before this
        self._retry_gap = self.after
        #: the prober's own back-off: the call it waits in, when (``clock``) it looks
        #: next whatever the book says, and the pause after that look (keyed on the call,
        #: not on one wait's duration: several threads may wait at once)
        self._own_call = -1
        self._next_look = 0.0
        self._gap = self.after
        self.clock: Callable[[], float] = time.monotonic

    # --- who is the prober ------------------------------------------------------------

    def live(self) -> list[int]:
        """The ranks that have neither left nor failed, this one included."""
        comm = self._comm
        gone, bye = comm.router.peer_gone, comm.departures.bye
        return [r for r in range(comm.world_size)
                if r == comm.rank or (r not in bye and gone(r) is None)]

    def prober(self) -> int:
        """The job's prober: its lowest-numbered live rank."""
        comm = self._comm
        gone, bye = comm.router.peer_gone, comm.departures.bye
        for r in range(comm.rank):
            if r not in bye and gone(r) is None:
                return r
        return comm.rank

    def on_note(self, src: int, call: int) -> None:
        """A ``BLOCKED`` note came (I/O thread): book it; the prober's wait acts on it."""
        self.notes.note(src, call)

    # --- the waits' hook --------------------------------------------------------------

    def probe(self, blocked_for: float) -> float:
        """Called by a thread blocked for ``blocked_for`` s. Off the prober: note it (a
        header-only frame) and come back on the doubling back-off. On the prober: look if
        the book says every rank is blocked (or its own back-off is due) and, on a
        confirmed deadlock, fail every rank; come back in ``POLL`` s (a glance, no I/O)."""
        comm = self._comm
        try:
            if comm.router.failure is not None or comm.closed:
                return MAX_BACKOFF
            call = call_id(comm.activity.since)
            prober = self.prober()
            if prober != comm.rank:
                comm.transport.send(prober, encode_header(Kind.BLOCKED, tag=call), None,
                                    time.monotonic() + 1.0)
                return max(self.after, min(blocked_for, MAX_BACKOFF))
            self.notes.note(comm.rank, call)
            if self._lock.acquire(blocking=False):
                try:
                    if self._due(call):
                        self._look_and_book()
                finally:
                    self._lock.release()
        except DistError:
            pass  # the prober is gone: failure detection tells, and the next note goes on
        except Exception as exc:  # noqa: BLE001 - detection must never break the wait
            log.debug("rankwise: deadlock probe on rank %d failed: %r", comm.rank, exc)
        return POLL

    def _due(self, call: int) -> bool:
        now = self.clock()
        if call != self._own_call:  # a new call: the back-off starts over
            self._own_call, self._next_look, self._gap = call, now, self.after
        if now < self._retry_at:
            return False
        return now >= self._next_look or self.notes.due(self.live(), self._seen)

    def _look_and_book(self) -> None:
        mark = self.notes.mark()
        self._next_look = self.clock() + self._gap
        self._gap = min(2 * self._gap, MAX_BACKOFF)
        reports = self._look()
        if reports is None:  # inconclusive: look again, backing off
            self._retry_at = self.clock() + self._retry_gap
            self._retry_gap = min(2 * self._retry_gap, MAX_BACKOFF)
            return
        self.notes.seen(reports, mark)
        self._seen, self._retry_at, self._retry_gap = mark, 0.0, self.after

    def _look(self) -> dict[int, Report] | None:
        """One look (two if the first shows a deadlock): the reports of a conclusive look
        that found no deadlock (every rank answered: someone computes, or the waits can
        complete), None when inconclusive (or a deadlock, then every rank fails)."""
        comm = self._comm
        first = comm.where_is_everyone(2.0)
        if find_deadlock(first, comm.rank) is None:
            if stalled_mismatch(first) is None:
                return None if any(rep.get("no_answer") for rep in first.values()) else first
            # ranks in the same collective with different calls, waiting on data planes
            # that never meet (CUDA tensors on NCCL, host memory on the CPU engine; or
            # engines that exchange no headers): a mismatch, not progress.
            # ``check_where`` looks again and fails every rank with both calls.
            comm.mismatches.check_where(
                f"rank {comm.rank} has waited {self.after:g}s in "
                f"{comm.calls.doing() or 'a wait'}")
            return None
        time.sleep(CONFIRM_GAP)  # not synchronisation: the pause that shows movement
        second = comm.where_is_everyone(2.0)
        if set(first) != set(second) or any(
                snapshot(first[r]) != snapshot(second[r]) for r in first):
            return None
        found = find_deadlock(second, comm.rank)
        if found is None or comm.router.failure is not None:
            return None
        message, calls = found
        # peers first: this rank raises and may exit right after, and the news must reach
        # them before its closed connection does
        comm.broadcast_abort({"kind": "deadlock", "rank": comm.rank, "message": message,
                              "ranks": {str(r): c for r, c in calls.items()},
                              "reports": {str(r): rep for r, rep in second.items()}})
        exc = DeadlockError(message, calls)
        exc.reports = second  # every rank's state at the deadlock, for RANKWISE_DUMP
        comm.router.fail_all(exc)
        return None
