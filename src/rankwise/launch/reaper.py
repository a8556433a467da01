"""One thread reaps every worker of a launcher: exits at once, stops within a second.

Why: a thread per worker blocked in ``waitpid`` costs N threads per launcher (256 at
256 local ranks). Here each worker's pidfd sits in one selector, so an exit wakes the
thread at once; stops (``WUNTRACED``, which no fd signals) are polled once per
``STOP_POLL`` s, which is plenty for a report that matters only at the timeout. Where
``pidfd_open`` is missing (Linux < 5.3) every worker is polled every ``FALLBACK_POLL`` s.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Callable

__all__ = ["FALLBACK_POLL", "STOP_POLL", "Reaper"]

STOP_POLL = 1.0  #: seconds between looks for stopped workers
FALLBACK_POLL = 0.05  #: seconds between looks when a worker has no pidfd

#: ``(kind, local_rank, wait status, time.time())``, kind "stop" or "exit"
Report = Callable[[str, int, int, float], None]


class Reaper:
    """Reaps the workers ``add``ed to it from one daemon thread, telling ``report``."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._lock = threading.Lock()
        self._ranks: dict[int, int] = {}  #: pid -> local rank, for workers not yet reaped
        self._fds: dict[int, int] = {}  #: pid -> its pidfd
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None

    def add(self, local_rank: int, pid: int) -> None:
        """Watch ``pid`` (a child of this process) until it exits."""
        try:
            fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        with self._lock:
            self._ranks[pid] = local_rank
            if fd is not None:
                self._fds[pid] = fd
                self._selector.register(fd, selectors.EVENT_READ, pid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rankwise-reaper",
                                                daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")  # a new timeout (a worker without a pidfd) applies now

    def _run(self) -> None:
        next_stop_look = time.monotonic() + STOP_POLL
        while True:
            with self._lock:
                polled = len(self._fds) < len(self._ranks)
            timeout = FALLBACK_POLL if polled else max(0.0, next_stop_look - time.monotonic())
            for key, _ in self._selector.select(timeout):
                if key.data is None:
                    _drain(self._wake_r)
                else:
                    self._look(key.data)
            if polled or time.monotonic() >= next_stop_look:
                next_stop_look = time.monotonic() + STOP_POLL
                with self._lock:
                    pids = list(self._ranks)
                for pid in pids:
                    self._look(pid)

    def _look(self, pid: int) -> None:
        """Report what ``pid`` did since the last look (nothing, a stop, or its exit)."""
        with self._lock:
            rank = self._ranks.get(pid)
        if rank is None:
            return
        try:
            got, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:  # reaped elsewhere: nothing more will be learned
            self._forget(pid)
            return
        if got == 0:
            return
        if os.WIFSTOPPED(status):
            self._report("stop", rank, status, time.time())
            return
        self._forget(pid)
        self._report("exit", rank, status, time.time())

    def _forget(self, pid: int) -> None:
        with self._lock:
            self._ranks.pop(pid, None)
            fd = self._fds.pop(pid, None)
            if fd is not None:
                self._selector.unregister(fd)
                os.close(fd)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
