"""``RANKWISE_DUMP=dir``: every rank leaves a post-mortem file behind.

Why: when a job dies (an error, a timeout, a signal from the scheduler) the evidence of
what each rank was doing dies with it, and the ranks' own messages are scattered over N
logs. With ``RANKWISE_DUMP`` set, each rank writes ``dir/rank<N>.json`` when it meets an
error (uncaught exception, a failure leaving the job, a timeout) or a signal (SIGTERM,
SIGINT; SIGUSR1 writes one and carries on): its recent call history per group, what it is
blocked in, and — when the others can still be asked (bounded, 1 s) — their who-is-where
answers as this rank saw them. ``rankwise analyze dir`` (``diagnosis.analyze``) merges the
files into one report: who failed first, where the ranks' histories diverged, who waited
for whom. The torch counterpart is the NCCL flight recorder and its analyzer script.

Writes are atomic (temp file + rename) and every later event rewrites the file with all
events so far, so the file always holds the latest, complete view.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

from ..checks.stragglers import book_of

__all__ = ["Dumper", "install_signal_dumps"]

log = logging.getLogger("rankwise")

ASK_TIMEOUT = 1.0  #: seconds a dump waits for the other ranks' answers
MAX_EVENTS = 32  #: events kept per rank (a failing rank can report the same thing often)


class Dumper:
    """One per communicator when ``RANKWISE_DUMP`` is set (see ``Communicator``)."""

    def __init__(self, directory: str, comm: Any) -> None:
        self.directory = directory
        self._comm = comm
        self._events: list[dict[str, Any]] = []
        self._view: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"rank{self._comm.rank}.json")

    def write(self, reason: str, ask_peers: bool = True) -> None:
        """Record ``reason`` and (re)write this rank's file; never raises."""
        try:
            self._write(reason, ask_peers)
        except Exception as exc:  # noqa: BLE001 - a post-mortem must not add a failure
            log.warning("rankwise: rank %d could not write its dump to %s: %r",
                        self._comm.rank, self.directory, exc)

    def _write(self, reason: str, ask_peers: bool) -> None:
        comm = self._comm
        view: dict[str, Any] = {}
        if ask_peers and not self._view and not comm.closed:  # once: later events reuse it
            view = {str(r): rep for r, rep in comm.where_is_everyone(ASK_TIMEOUT).items()}
        with self._lock:
            if len(self._events) < MAX_EVENTS:
                self._events.append({"time": time.time(), "reason": reason[:20000]})
            if view:
                self._view = view
            record = {
                "rank": comm.rank,
                "world_size": comm.world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "written": time.time(),
                "events": list(self._events),
                "report": comm.where.mine(),
                "view": self._view,
                "at_failure": _failure_reports(comm),
                "stragglers": book_of(comm),
            }
            os.makedirs(self.directory, exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(record, fh, indent=1, default=str)
            os.replace(tmp, self.path)


def _failure_reports(comm: Any) -> dict[str, Any]:
    """Every rank's state at the moment of the failure, where the failure carried it (a
    deadlock's confirming look): by the time a rank writes its dump, its call has ended."""
    reports = getattr(comm.router.failure, "reports", None)
    if not isinstance(reports, dict):
        return {}
    return {str(r): rep for r, rep in reports.items()}


_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def install_signal_dumps(current: Any) -> None:
    """Dump on SIGTERM/SIGINT (then do what the previous handler did) and on SIGUSR1
    (and carry on: ``kill -USR1 <pid>`` inspects a live job). ``current()`` gives the
    communicator or None. Main thread only (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in _SIGNALS:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        previous = signal.getsignal(signum)
        if getattr(previous, "_rankwise_dump", False):
            continue
        if name == "SIGUSR1" and previous not in (signal.SIG_DFL, None):
            continue  # the user's own SIGUSR1 handler stays

        def handler(num: int, frame: FrameType | None, previous: Any = previous,
                    name: str = name) -> None:
            comm = current()
            dumper = getattr(comm, "dumper", None)
            if dumper is not None:
                # local only: the peers may be receiving the same signal right now
                dumper.write(f"signal {name}", ask_peers=False)
            if name == "SIGUSR1":
                return
            if callable(previous):
                previous(num, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # the default action (terminate): restore it and re-deliver
                signal.signal(num, signal.SIG_DFL)
                os.kill(os.getpid(), num)

        handler._rankwise_dump = True  # type: ignore[attr-defined]
        try:
            signal.signal(signum, handler)
        except (ValueError, OSError):
            continue
