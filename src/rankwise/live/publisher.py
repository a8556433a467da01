"""Rank side of the live page: a small snapshot of this rank, put in the job's store.

Why through the store: the page is served on node 0 by the launcher, which already hosts
the store every rank reaches; the page never connects to a rank. Why a thread that looks
every ``PERIOD`` seconds: the snapshot is read from what the call log keeps anyway (the
current ``Activity``, each group's sequence number and history), so a collective pays
nothing for the page. One store connection per rank, its own: the user's thread may be
inside a store call. Stacks are read only when the page asks (a counter in the store).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from .. import settings
from ..checks.report import _state
from ..checks.stragglers import book_of
from ..identity.stacks import current_frames

__all__ = ["PAGE_KEY", "PERIOD", "LivePublisher", "ask_key", "current_publisher", "rank_key",
           "stacks_key", "start_publisher", "started_key"]

PERIOD = 0.5  #: seconds between snapshots
RECENT = 8  #: finished collectives per snapshot
REPORT_CHARS = 20000  #: of a failure's text


def rank_key(attempt: int, rank: int) -> str:
    return f"rankwise/live/{attempt}/rank/{rank}"


PAGE_KEY = "rankwise/live/page"  #: set by the launcher that serves the page


def started_key(attempt: int) -> str:
    return f"rankwise/live/{attempt}/started"


def ask_key(attempt: int, rank: int) -> str:
    return f"rankwise/live/{attempt}/ask/{rank}"


def stacks_key(attempt: int, rank: int) -> str:
    return f"rankwise/live/{attempt}/stacks/{rank}"


def _itemsize(call: Any) -> int:
    dtype = call.dtype
    return int(dtype.storage.itemsize) if dtype is not None else 0


class LivePublisher:
    """One per rank process started by ``rankwise run`` with the page on."""

    def __init__(self, comm: Any, store: Any, attempt: int) -> None:
        self._comm = comm
        self._store = store
        self._attempt = attempt
        self._stop = threading.Event()
        self._lock = threading.Lock()  #: one store request at a time (thread, atexit)
        self._n = 0
        self._calls = 0
        self._bytes = 0.0
        self._asked = 0
        self._began = time.time()
        self.cpu_s = 0.0  #: CPU time this rank's snapshot thread used (its whole cost)
        self._thread = threading.Thread(target=self._loop, name="rankwise-live", daemon=True)

    def start(self, at_exit: bool = True) -> None:
        """Start the snapshot thread (and, for a process, a last snapshot at exit)."""
        self._thread.start()
        if at_exit:
            atexit.register(self.final)

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict[str, Any]:
        """This rank now: state, totals, the last finished collectives (no stack read
        beyond the one line who-is-where shows for a rank in user code)."""
        comm, now = self._comm, time.time()
        a = comm.activity
        groups = list(comm.groups.values())
        calls = sum(g.seq for g in groups)
        recent = sorted((c for g in groups for c in g.recent(RECENT) if c.finished),
                        key=lambda c: c.finished)[-RECENT:]
        if calls > self._calls and recent:  # bytes of calls made since the last look
            per_call = sum(max(0, c.fp.count) * _itemsize(c) for c in recent) / len(recent)
            self._bytes += per_call * (calls - self._calls)
        self._calls = calls
        self._n += 1
        group = comm.groups.get(a.group) if a.op else None
        failure = comm.router.failure
        return {
            "rank": comm.rank, "world_size": comm.world_size, "host": socket.gethostname(),
            "pid": os.getpid(), "n": self._n, "began": self._began,
            "mono": time.monotonic(), "time": now,
            "state": _state(comm, now), "op": a.op, "kind": a.kind if a.op else "",
            "group": group.name if group is not None else "", "seq": a.seq if a.op else 0,
            "since": a.since, "site": a.site.chain if a.op else "",
            "calls": calls, "bytes": int(self._bytes),
            "recent": [{"call": c.describe(site=False), "group": c.group.name, "seq": c.seq,
                        "ms": round((c.finished - c.started) * 1000, 3),
                        "site": c.site.short} for c in reversed(recent)],
            "failed": (f"{type(failure).__name__}: {failure}"[:REPORT_CHARS]
                       if failure is not None else ""),
            "closed": bool(comm.closed), "publisher_cpu_s": round(self.cpu_s, 4),
            "stragglers": book_of(comm),
        }

    def publish(self) -> None:
        """Put a snapshot, and this rank's stacks if the page asked; never raises."""
        try:
            with self._lock:
                self._store.set(rank_key(self._attempt, self._comm.rank),
                                json.dumps(self.snapshot(), default=str))
                asked = self._store.add(ask_key(self._attempt, self._comm.rank), 0)
                if asked > self._asked:
                    self._asked = asked
                    self._store.set(stacks_key(self._attempt, self._comm.rank),
                                    json.dumps({"asked": asked, "time": time.time(),
                                                "stacks": all_stacks()}))
        except Exception:  # noqa: BLE001 - the page must never hurt the job
            return

    def final(self) -> None:
        """At exit: the last state (and the failure, if any) for the page."""
        self._stop.set()
        self.publish()

    def _loop(self) -> None:
        """Every ``PERIOD``, and at once when this rank learns of a failure (the report
        must reach the page before the process exits)."""
        last, failed = time.monotonic(), False
        while not self._stop.wait(0.1):
            cpu = time.thread_time()
            now_failed = self._comm.router.failure is not None
            if time.monotonic() - last >= PERIOD or (now_failed and not failed):
                self.publish()
                last, failed = time.monotonic(), now_failed
            self.cpu_s += time.thread_time() - cpu


def all_stacks() -> str:
    """Every thread's Python stack, innermost last (as a traceback reads)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in current_frames().items():
        out.append(f"Thread {names.get(ident, ident)}:\n"
                   + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


_current: LivePublisher | None = None


def current_publisher() -> LivePublisher | None:
    """This process's publisher, if ``rankwise run`` started one (benchmarks read its
    ``cpu_s``)."""
    return _current


def start_publisher(comm: Any) -> LivePublisher | None:
    """A publisher for ``comm`` when ``rankwise run`` serves the page (``RANKWISE_LIVE=1``
    in the worker's environment, and the page's key in the job's store: every node's
    launcher sets the variable, only node 0's serves the page), connected to the job's
    store; else None."""
    if not settings.flag("RANKWISE_LIVE"):
        return None
    from ..store import TCPStore

    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=5),
                         token=settings.text("RANKWISE_TOKEN"))
    except Exception:  # noqa: BLE001 - no page is better than a failed job
        return None
    try:
        served = store.check([PAGE_KEY])  # node 0 may run with --no-live
    except Exception:  # noqa: BLE001
        served = False
    if not served:
        store.close()
        return None
    attempt = settings.integer("RANKWISE_RESTART_COUNT", 0)
    global _current
    publisher = _current = LivePublisher(comm, store, attempt)
    publisher.publish()
    try:
        store.add(started_key(attempt), 1)
    except Exception:  # noqa: BLE001
        return None
    publisher.start()
    return publisher
