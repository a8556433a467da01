"""Mismatch diagnosis: ranks that made different calls, found and explained on every rank.

Why its own piece: a mismatch is found two ways — a frame whose header contradicts our
call (the router tells us), or a who-is-where table that shows ranks blocked in the
same collective with different calls (no frame crossed) — and both must end the same
way: every waiter poisoned at once, the message completed with the divergence report
(every rank's recent history, bounded), the peers told before this rank may exit.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..checks.report import (
    format_where,
    mismatch_report,
    rank_list,
    reported_shape,
    stalled_mismatch,
)
from ..errors import CollectiveMismatch
from ..identity.calls import Fingerprint, describe, flags_shown, mismatch_advice
from ..identity.callsite import CallSite, enabled
from ..wire.frames import Frame
from .failures import mismatch_sentence

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Mismatches"]


class Mismatches:
    """Finds, words and reports this rank's side of a mismatch (once per job)."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._diagnosing = False
        self._lock = threading.Lock()
        self._done: threading.Event | None = None  #: set once the report is in the error

    def on_mismatch(self, frame: Frame, fp: Fingerprint | None, detail: str) -> None:
        """The router's handler: ``frame`` contradicts our call ``fp`` (None: unknown)."""
        comm = self._comm
        message = self._message(frame, fp, detail)
        with self._lock:
            if self._diagnosing or comm.router.failure is not None:
                return
            self._diagnosing = True
            if enabled():
                self._done = threading.Event()
        # Poison at once (no later frame may be used), but hold this rank's waiters in
        # ``wait`` until the report is in the exception: see ``await_diagnosis``.
        exc = CollectiveMismatch(message)
        comm.router.fail_all(exc)
        if self._done is None:
            comm.broadcast_abort({"kind": "mismatch", "rank": comm.rank, "message": message},
                                 background=True)
            return
        threading.Thread(target=self._diagnose, args=(frame, fp, detail, exc),
                         name="rankwise-diagnose", daemon=True).start()

    def check_where(self, headline: str) -> str:
        """Gather the table; if it shows ranks blocked in the same collective with
        different calls (a mismatch no frame revealed), fail every rank with it now."""
        comm = self._comm
        reports = comm.where_is_everyone(2.0)
        table = format_where(reports, headline)
        found = stalled_mismatch(reports)
        if found is None:
            return table
        group, seq, calls = found
        g = comm.groups.get(group)
        gname = g.name if g is not None else f"group {group}"
        sides = [f"{rank_list(ranks)} called {call} at "
                 f"{reports[ranks[0]].get('site') or '<unknown>'}"
                 for call, ranks in sorted(calls.items(), key=lambda kv: kv[1][0])]
        first = sorted(calls.values(), key=lambda rs: rs[0])
        texts = sorted(calls, key=lambda c: calls[c][0])
        message = mismatch_sentence(
            gname, seq, sides,
            f". No message crossed between them (each waits to receive), so rank "
            f"{comm.rank} found it by asking every rank where it is. "
            + mismatch_advice(flags_shown(texts[0]), flags_shown(texts[1])) + "\n\n"
            + mismatch_report(reports, group, seq, first[0][0], first[1][0]))
        with self._lock:
            if comm.router.failure is not None:
                return table
            self._diagnosing = True
        comm.broadcast_abort({"kind": "mismatch", "rank": comm.rank, "message": message})
        comm.router.fail_all(CollectiveMismatch(message))
        return table

    def tell(self, message: str) -> None:
        """Tell the peers about a mismatch this rank found, with this rank's report.
        Peers before our own raise: this rank may exit right after, and the abort must
        reach them before its closed connection does; a peer still gathering reports for
        its own message then has our history even if its question comes after we left."""
        comm = self._comm
        comm.broadcast_abort({"kind": "mismatch", "rank": comm.rank, "message": message,
                              "report": comm.where.mine()})

    def await_diagnosis(self, timeout: float = 5.0) -> None:
        """Block (bounded) until a mismatch report being built is in its exception."""
        done = self._done
        if done is not None:
            done.wait(timeout)

    def _message(self, frame: Frame, fp: Fingerprint | None, detail: str,
                 reports: dict[int, dict[str, Any]] | None = None) -> str:
        """Both calls, in the user's words. The peer's tensor shape is not in its frame
        (which carries element counts): it comes from its report, when there is one."""
        comm = self._comm
        shape = (None if reports is None else
                 reported_shape(reports, frame.src, frame.group, frame.seq))
        theirs = describe(frame, comm.peer_sites[frame.src].get(frame.site), shape)
        group = comm.groups.get(frame.group)
        record = group.record_of(frame.seq) if group is not None else None
        ours = (describe(fp, self._site_of_seq(frame.group, frame.seq),
                         record.shape if record is not None else None)
                if fp is not None else "(a different call)")
        gname = f"group {frame.group}" if group is None else group.name
        return mismatch_sentence(
            gname, frame.seq, [f"rank {comm.rank} called {ours}", f"rank {frame.src} called {theirs}"],
            ". " + (detail + ". " if detail else "")
            + mismatch_advice(frame.flags, fp.flags if fp is not None else 0))

    def _diagnose(self, frame: Frame, fp: Fingerprint | None, detail: str,
                  exc: CollectiveMismatch) -> None:
        """Off the I/O thread: gather every rank's history (bounded), complete the
        exception's message, tell the peers, then release this rank's waiters."""
        assert self._done is not None
        comm = self._comm
        report = ""
        message = str(exc)
        try:
            reports = comm.where_is_everyone(2.0)
            message = self._message(frame, fp, detail, reports)
            report = mismatch_report(reports, frame.group, frame.seq, comm.rank, frame.src)
        except Exception as err:  # noqa: BLE001 - a report must never hide the mismatch
            report = f"(the divergence report failed: {err!r})"
        full = message + ("\n\n" + report if report else "")
        exc.args = (full,)
        try:
            self.tell(full)
        finally:
            self._done.set()

    def _site_of_seq(self, group: int, seq: int) -> CallSite | None:
        comm = self._comm
        if comm.site_lookup is not None:
            return comm.site_lookup(group, seq)
        g = comm.groups.get(group)
        return g.site_of(seq) if g is not None else None
