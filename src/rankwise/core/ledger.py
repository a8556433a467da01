"""One ledger of device work in flight per process, and the one thread that watches it.

Why: a device collective returns before its kernel ends, so something must bound it (a
deadline, a failed peer) without the caller's thread blocking on it. torch keeps one
list of works per group that ``workEnqueue`` appends to under a mutex without waking
anybody, and a watchdog thread that looks at it every 100 ms; torchft one ledger of
in-flight work that aborts the group on error. Here: each group keeps its own records
(a ``Book``: ``engines.torch.work_book.WorkBook``), appended by the caller without a lock
or a wake-up, and this module's one thread per process passes over the books only when
one of them asked for a pass by then (the nearest deadline, grace or slow-call time of
its records) or was kicked (a failure pushed by the port, a new first record, a
future waiting for its kernels). Measurements: docs/gpu.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Book", "Ledger", "ledger"]

log = logging.getLogger("rankwise")

#: seconds between two passes over a book whose pass raised (the thread outlives it)
_AFTER_ERROR = 0.1


class Book(Protocol):
    """A group's records as the ledger's thread sees them."""

    def pass_due(self) -> float:
        """One pass over the records (settle the finished ones, abort past a deadline);
        seconds until the book needs the next (``math.inf``: only when kicked)."""


class Ledger:
    """The process's books and the thread that passes over them when one is due.

    ``kick(delay)``: some book needs a pass within ``delay`` seconds; it wakes the
    thread only when that is sooner than the thread's own next wake-up, so a call that
    appends a record behind others costs a float comparison here, nothing more."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._books: list[Book] = []
        #: when (``clock``) the thread wakes next; read without the lock by ``kick``
        self.wake_at = math.inf
        self._thread: threading.Thread | None = None
        self._pid = 0

    def register(self, book: Book) -> None:
        import os

        with self._cond:
            self._books.append(book)
            if self._thread is None or self._pid != os.getpid():  # a fork has none
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="rankwise-ledger",
                                                daemon=True)
                self._thread.start()

    def unregister(self, book: Book) -> None:
        with self._cond:
            if book in self._books:
                self._books.remove(book)

    def kick(self, delay: float = 0.0) -> None:
        """A book needs a pass within ``delay`` seconds."""
        at = self.clock() + delay
        if at < self.wake_at:
            with self._cond:
                if at < self.wake_at:
                    self.wake_at = at
                    self._cond.notify()

    def books(self) -> int:
        with self._cond:
            return len(self._books)

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    wait = self.wake_at - self.clock()
                    if wait <= 0:
                        break
                    cond.wait(None if wait == math.inf else wait)
                # from here a kick of any delay wakes the next round
                self.wake_at = math.inf
                books = list(self._books)
            due = math.inf
            for book in books:
                try:
                    due = min(due, book.pass_due())
                except Exception:  # the ledger outlives a bad pass
                    log.exception("rankwise: a pass over %r failed", book)
                    due = min(due, _AFTER_ERROR)
            if due < math.inf:
                self.kick(max(0.0, due))


_ledger: Ledger | None = None
_lock = threading.Lock()


def ledger() -> Ledger:
    """The process's ledger (made on first use)."""
    global _ledger
    if _ledger is None:
        with _lock:
            if _ledger is None:
                _ledger = Ledger()
    return _ledger
