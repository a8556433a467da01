"""Peers that fail or leave: aborts, goodbyes, lost connections, and this rank's own.

Why its own piece: "another rank is gone" arrives four ways — its ABORT frame (it
failed, or relays who did), its BYE (it left cleanly), its connection closing without
either (it died), or our own reader failing — and each must become one exception in
every waiting thread at once, worded for what *this* rank is doing when it raises.
When this rank leaves, it tells the others the same way (goodbye, or the root cause).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..checks.aborts import AbortInfo, abort_error, kind_of, parse_abort
from ..errors import DistError, DistNetworkError, PeerFailure
from ..identity.calls import describe
from ..transport.base import passes_on
from ..wire.frames import Frame, Kind

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Departures"]

log = logging.getLogger("rankwise")


class Departures:
    """Turns peers' failures and departures into exceptions; announces this rank's."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.bye: dict[int, str] = {}  #: peers that said goodbye, with where they left
        #: the who-is-where report a peer sent with its mismatch abort: it may have left
        #: before our own question reached it
        self.last_reports: dict[int, dict[str, Any]] = {}
        self.last_seen: dict[int, Frame] = {}  #: last collective frame from each peer
        #: the first peer whose goodbye a wait of this rank raised (rank, where it left):
        #: our own goodbye names it, so a peer that reads ours first blames that rank
        self.suffered: tuple[int, str] | None = None
        #: this rank said goodbye: a peer that closes now may have skipped its own goodbye
        #: to us (it heard ours), so its close is no news to pass on
        self.leaving = False
        #: peers whose connection closed without a goodbye: dead as far as this rank
        #: knows (what ``rankwise.shrink`` reports as this rank's view)
        self.lost: set[int] = set()

    # --- what peers tell us ---------------------------------------------------------------

    def on_abort(self, src: int, payload: bytes) -> None:
        comm = self._comm
        info = parse_abort(payload)
        report = info.get("report")
        if isinstance(report, dict):
            self.last_reports[src] = report
        first = comm.router.failure is None
        comm.router.fail_all(abort_error(AbortInfo(info, src, comm.rank, comm.calls.doing())))
        if first and passes_on(comm.transport):  # not every rank heard it: pass it on
            self.broadcast_abort(info, background=True)

    def on_bye(self, src: int, payload: bytes) -> None:
        text, _, cause = payload.decode("utf-8", "replace").partition("\0")
        where = text[:2000]
        self.bye[src] = where
        after = _left_after(cause)
        if after is not None and after[0] not in (self._comm.rank, src) \
                and after[0] < self._comm.world_size:
            # src left because another rank's leaving failed its wait: name that rank
            self._comm.router.fail_peer(src, self.departed_error(after[0], after[1], via=src))
            return
        self._comm.router.fail_peer(src, self.departed_error(src, where))

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        comm = self._comm
        if comm.closed:
            return
        bye = self.bye.get(rank)
        if bye is not None:
            comm.router.fail_peer(rank, self.departed_error(rank, bye))
            return
        self.lost.add(rank)
        mine = comm.calls.doing()
        last = self.last_from(rank)
        exc = PeerFailure(
            f"rank {rank} died: its connection to rank {comm.rank} was lost "
            f"({reason or 'closed'}) without a goodbye — the process crashed, was killed "
            f"(SIGKILL, out of memory), or its machine went away. Last collective seen from "
            f"rank {rank}: {last or self._unrecorded()}"
            + (f"; rank {comm.rank} was in {mine}" if mine else ""),
            rank=rank, last_collective=last,
        )
        first = comm.router.failure is None
        comm.router.fail_all(exc)
        if first and passes_on(comm.transport) and not self.leaving:
            self.broadcast_abort(self.relay_of(exc), background=True)  # to unconnected ranks

    def on_fatal(self, exc: DistError) -> None:
        """The transport's reader failed unexpectedly: fail every waiter with ``exc`` and
        tell the peers, which would otherwise wait for this rank until their timeout."""
        self._fail_loudly(exc)

    def on_protocol_error(self, src: int, message: str) -> None:
        self._fail_loudly(DistNetworkError(message))

    def _fail_loudly(self, exc: DistError) -> None:
        comm = self._comm
        if comm.closed:
            return
        first = comm.router.failure is None
        comm.router.fail_all(exc)
        if first:
            self.broadcast_abort({"kind": "exception", "rank": comm.rank,
                                  "message": f"{type(exc).__name__}: {exc}"}, background=True)

    # --- wording -----------------------------------------------------------------------------

    def departed_error(self, rank: int, where: str, via: int | None = None) -> PeerFailure:
        comm = self._comm
        doing = comm.calls.doing() or "a call"
        hint = ("the ranks make different numbers of calls (uneven loop counts, or a "
                "collective on some ranks only?)")
        if comm.activity.op == "barrier" and \
                comm.calls.call_of(comm.activity).startswith("rank_zero_first"):
            hint = ("only some ranks entered rank_zero_first/main_process_first: every rank "
                    "of the group must enter it (do not call it from a rank-0-only branch)")
        passed = f"\n(passed on by rank {via}, which left after it)" if via is not None else ""
        exc = PeerFailure(f"rank {rank} finished and {where} while rank {comm.rank} waits "
                          f"in {doing}: {hint}{passed}", rank=rank)
        exc.departed_where = where  # type: ignore[attr-defined]  # re-phrased in wait()
        exc.departed_via = via  # type: ignore[attr-defined]
        return exc

    def as_of_now(self, failure: BaseException) -> BaseException:
        """A peer's goodbye, re-phrased to say what *this* rank is in now, not what it
        was doing when the goodbye came; other failures as they are."""
        where = getattr(failure, "departed_where", None)
        rank = getattr(failure, "rank", None)
        if where is None or rank is None:
            return failure
        if self.suffered is None:
            self.suffered = (rank, where)
        return self.departed_error(rank, where, getattr(failure, "departed_via", None))

    def _unrecorded(self) -> str:
        """What to say when no frame of the peer's named a collective: "none" only when
        this rank finished none either (an engine that moves data without frames, such as
        shared memory, records no peer's calls)."""
        mine = self._comm.last_call
        return f"not recorded (rank {self._comm.rank}'s last finished: {mine})" if mine \
            else "none"

    def last_from(self, rank: int) -> str:
        """The last collective ``rank`` was seen in (its frames, or an engine's view)."""
        comm = self._comm
        frame = self.last_seen.get(rank)
        if frame is None:
            return next((text for source in comm.peer_call_sources
                         if (text := source(rank))), "")
        site = comm.peer_sites.get(rank, {}).get(frame.site)
        return f"{describe(frame, site)} (#{frame.seq} of group {frame.group})"

    # --- what we tell the peers ----------------------------------------------------------

    def broadcast_abort(self, info: dict[str, Any], background: bool = False,
                        timeout: float = 2.0) -> None:
        """Tell every peer that this rank failed. In the background when called from the
        I/O thread (which must keep draining so peers' sends cannot block it)."""
        payload = json.dumps(info).encode()[: (8 << 20)]
        sender = self._comm.sender

        def run() -> None:
            sender.tell_everyone(Kind.ABORT, payload, time.monotonic() + timeout)

        if background:
            threading.Thread(target=run, name="rankwise-abort", daemon=True).start()
        else:
            run()

    def relay_of(self, failure: BaseException) -> dict[str, Any]:
        """The ABORT that passes on a failure this rank only suffered (a dead or failed
        peer, a mismatch): it names the rank where it started, so peers that hear from us
        first blame the right rank, not us."""
        comm = self._comm
        origin = getattr(failure, "rank", None)
        return {"kind": kind_of(failure),
                "rank": comm.rank if origin is None else origin, "relayed_by": comm.rank,
                "message": str(failure)[:20000],
                "traceback": str(getattr(failure, "remote_traceback", ""))[:40000],
                "last": str(getattr(failure, "last_collective", ""))}

    def _bye_payload(self, where: str) -> bytes:
        """Where this rank leaves, and which peer's leaving it raised of, if any."""
        text = where.encode()[:2000]
        if self.suffered is None:
            return text
        rank, its_where = self.suffered
        return text + b"\0" + json.dumps({"after": rank, "where": its_where[:2000]}).encode()

    def goodbye(self, where: str, timeout: float = 2.0) -> None:
        """Tell peers we leave cleanly, then close the connections."""
        comm = self._comm
        if comm.closed:
            return
        if comm.tracer is not None:
            try:
                comm.tracer.write()
            except OSError as exc:
                log.warning("rankwise: could not write the trace of rank %d: %s", comm.rank, exc)
        failure = comm.router.failure
        if failure is None:
            # answers to "where are you?" first: a peer stops waiting for ours once it has
            # our goodbye, so an answer sent after it would be lost ("exited" in its report)
            comm.where.settle(min(timeout, 1.0))
            self.leaving = True
            comm.sender.tell_everyone(Kind.BYE, self._bye_payload(where),
                                      time.monotonic() + timeout)
        else:
            # Leaving after a failure: pass the root cause on. Without this, a peer that
            # notices our closed connection before the original one blames us.
            self.broadcast_abort(self.relay_of(failure), timeout=timeout)
            if comm.dumper is not None:
                comm.dumper.write(f"left after {type(failure).__name__}: {failure}")
        comm.where.settle(min(timeout, 1.0))
        comm.closed = True
        if comm.heartbeat is not None:
            comm.heartbeat.stop()
        comm.transport.close()


def _left_after(cause: str) -> tuple[int, str] | None:
    """The (rank, where) a goodbye says its sender left after; None if none or unreadable
    (the payload is untrusted)."""
    if not cause:
        return None
    try:
        info = json.loads(cause)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    rank, where = info.get("after"), info.get("where")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return None
    return rank, str(where)[:2000]
