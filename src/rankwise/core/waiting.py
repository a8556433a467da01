"""Waiting for a posted receive: bounded, watched, and explained when it runs long.

Why its own piece: every blocking wait of every engine goes through one policy — read
for ourselves while a large call is in flight, from ``deadlock.after`` seconds on ask
whether every rank is blocked for good, at ``RANKWISE_WARN_AFTER`` log who is where, at
the deadline raise ``DistTimeout`` carrying that table — and the fast path pays for
none of it beyond a clock read.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import CollectiveMismatch, DistTimeout, PeerFailure
from ..transport.base import watch
from ..wire.frames import Frame
from .router import Pending

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Waiter"]

log = logging.getLogger("rankwise")

_REACH_AFTER = 1.0  #: seconds of waiting on one rank before ``transport.watch`` of it


class Waiter:
    """The communicator's ``wait``: phases, warnings, and the errors they end in."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm

    def wait(self, pending: Pending, deadline: float, what: Callable[[], str], *,
             patient: bool = False, quiet: bool = False) -> Frame:
        """Wait for ``pending`` in two phases: until the warning threshold, then (after
        logging a who-is-where table) until ``deadline``; a timeout carries the table.

        ``patient``: waiting on purpose (rank_zero_first's followers): no slow-wait
        warning, still bounded by ``deadline``.
        ``quiet``: no table, a bare ``DistTimeout`` (the caller reports by itself).
        """
        comm = self._comm
        try:
            try:
                return self._block(pending, deadline, what, patient, quiet)
            finally:
                self._stop_driving_unless_done(pending)
        except DistTimeout:
            comm.router.cancel(pending)
            if quiet:
                raise
            table = comm.mismatches.check_where(f"rank {comm.rank} timed out in "
                                                f"{comm.calls.doing() or 'a wait'}")
            if comm.dumper is not None:
                comm.dumper.write(f"DistTimeout: {what()}")
            failure = comm.router.failure
            if isinstance(failure, CollectiveMismatch):  # the table explained the hang
                raise failure from None
            raise DistTimeout(what() + self._held_note(), report=table) from None
        except PeerFailure as exc:
            now = comm.as_of_now(exc)
            if now is exc:
                raise
            raise now from None
        except CollectiveMismatch:
            comm.await_diagnosis()  # raise it with the divergence report in it
            raise

    def warn_slow(self, what: Callable[[], str]) -> None:
        """A wait passed ``warn_after``: rank 0 logs who is where (or fails every rank at
        once if the table shows a mismatch no message revealed); the others log their own
        line only, so a slow job prints one table, not one per rank (docs/scale.md)."""
        comm = self._comm
        if comm.rank != 0:  # one table per job, not N (N^2 lines and probes at scale)
            log.warning("rankwise: slow wait on rank %d — %s (rank 0 logs who is where "
                        "when it waits too)", comm.rank,
                        what().replace(" timed out after", " still waiting; timeout is"))
            return
        try:
            table = comm.mismatches.check_where(
                f"rank {comm.rank} has waited {comm.warn_after:g}s (RANKWISE_WARN_AFTER) in "
                f"{comm.calls.doing() or 'a wait'}")
            if comm.router.failure is not None:
                return  # the table explained the wait: the waiter raises, no warning
            log.warning("rankwise: slow wait on rank %d — %s\n%s", comm.rank,
                        what().replace(" timed out after", " still waiting; timeout is"), table)
        except Exception as exc:  # noqa: BLE001 - diagnosis must never break the wait
            log.warning("rankwise: rank %d could not build a who-is-where report: %r",
                        comm.rank, exc)

    def _held_note(self) -> str:
        """Why a timeout may have happened on our side: peers we stopped reading because
        what they sent, nobody here received (see the parking caps in ``core.router``)."""
        comm = self._comm
        stats = comm.router.parked()
        held = stats["held"]
        if not held:
            return ""
        per_peer = stats["per_peer"]
        assert isinstance(held, list) and isinstance(per_peer, dict)
        return (f"; rank {comm.rank} stopped reading rank(s) {held}: messages from them that "
                f"no receive here asked for fill its room ({per_peer} bytes parked; caps "
                f"{stats['per_peer_cap']} per peer, {stats['total_cap']} in all: "
                "RANKWISE_PARKED_PER_PEER / RANKWISE_PARKED_TOTAL) — post the matching recv")

    def _block(self, pending: Pending, deadline: float, what: Callable[[], str],
               patient: bool, quiet: bool) -> Frame:
        """The waiting itself, in the phases ``wait`` describes."""
        if pending.completed:
            return pending.wait(deadline, what)
        comm = self._comm
        start = time.monotonic()
        if comm.transport.driving():
            self._drive(pending, deadline if quiet else
                        min(deadline, start + min(comm.warn_after, comm.deadlock.after)))
            if pending.completed:
                return pending.wait(deadline, what)  # an error: ``wait`` stops driving
            comm.transport.drive_end()  # past the first threshold: the I/O thread reads
        if quiet:
            return pending.wait(deadline, what)
        return self._watch(pending, start, deadline, what, patient)

    def _watch(self, pending: Pending, start: float, deadline: float,
               what: Callable[[], str], patient: bool) -> Frame:
        """A wait past the fast path: from ``deadlock.after`` s on, ask (backing off)
        whether every rank is blocked for good; at ``warn_after`` s log who is where
        (not when ``patient``); at ``deadline`` time out."""
        comm = self._comm
        warn_at = math.inf if patient else start + comm.warn_after
        probe_at = start + comm.deadlock.after
        #: connections opened on demand: past this, make sure the end of the rank we wait
        #: on would be heard here even if we never exchanged a frame (``transport.watch``)
        reach_at = start + _REACH_AFTER
        while True:
            until = min(warn_at, probe_at, reach_at)
            if until >= deadline:
                return pending.wait(deadline, what)
            try:
                return pending.wait(until, what)
            except DistTimeout:
                pass
            now = time.monotonic()
            if now >= reach_at:
                reach_at = math.inf
                watch(comm.transport, pending.src)
            if now >= warn_at:
                warn_at = math.inf
                self.warn_slow(what)
            if now >= probe_at:
                probe_at = time.monotonic() + comm.deadlock.probe(now - start)

    def _drive(self, pending: Pending, limit: float) -> None:
        """Read for ourselves until ``pending`` completes or ``limit`` (transport.drive_begin)."""
        progress = self._comm.transport.progress
        while not pending.completed:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return
            progress(min(remaining, 0.25))

    def _stop_driving_unless_done(self, pending: Pending) -> None:
        """Anything but a clean completion hands reading back to the I/O thread before the
        caller goes on: warning tables, diagnosis and error reports wait for answers from
        the peers, and only a reader gets those to them."""
        if not pending.completed or pending.error is not None:
            self._comm.transport.drive_end()
