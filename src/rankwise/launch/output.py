"""Copy each worker's stdout/stderr to the console (``[rank N] `` prefixed) and/or a log file.

Why one thread for all pipes: a worker's pipe must be drained as fast as it writes or
the worker blocks on a full pipe, and a thread per stream did that for a handful of
ranks but made 2N threads for N workers (at 256 ranks the launcher held 770 threads).
One daemon thread waits on a selector holding every worker's pipes, reads what is
there and passes on whole lines; it costs nothing while the workers are quiet. Whole
lines are written under one lock so ranks never interleave mid-line.
"""

from __future__ import annotations

import os
import selectors
import sys
import threading
from typing import IO, BinaryIO

__all__ = ["StreamPump"]

_console_lock = threading.Lock()
_READ = 64 * 1024
_LONGEST_LINE = 1 << 20  #: a line longer than this is passed on in pieces


class _Hub:
    """The one thread that drains every registered pipe (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._new: list[StreamPump] = []
        self._thread: threading.Thread | None = None

    def add(self, pump: StreamPump) -> None:
        with self._lock:
            self._new.append(pump)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rankwise-pumps",
                                                daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        new, self._new = self._new, []
                    for pump in new:
                        self._sel.register(pump.fd, selectors.EVENT_READ, pump)
                    continue
                pump = key.data
                if not pump.pump():
                    self._sel.unregister(pump.fd)
                    pump.finish()


_hub: _Hub | None = None
_hub_lock = threading.Lock()


def _the_hub() -> _Hub:
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = _Hub()
        return _hub


class StreamPump:
    """Drain one pipe line by line into ``console`` (optional) and ``log`` (optional)."""

    def __init__(
        self,
        source: IO[bytes],
        prefix: bytes,
        console: BinaryIO | None,
        log: BinaryIO | None,
        name: str,
    ) -> None:
        self._source = source
        self.fd = source.fileno()
        self._prefix = prefix
        self._console = console
        self._log = log
        self.name = name
        self._partial = b""
        self._done = threading.Event()
        os.set_blocking(self.fd, False)
        _the_hub().add(self)

    def pump(self) -> bool:
        """Copy what the pipe holds (hub thread); False at end of file."""
        try:
            data = os.read(self.fd, _READ)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            if self._partial:
                self._emit([self._partial])
                self._partial = b""
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        whole = [line + b"\n" for line in lines]
        if len(self._partial) > _LONGEST_LINE:
            whole.append(self._partial)
            self._partial = b""
        if whole:
            self._emit(whole)
        return True

    def _emit(self, lines: list[bytes]) -> None:
        try:
            if self._log is not None:
                self._log.write(b"".join(lines))
                self._log.flush()
            if self._console is not None:
                text = b"".join(self._prefix + (line if line.endswith(b"\n") else line + b"\n")
                                for line in lines)
                with _console_lock:
                    self._console.write(text)
                    self._console.flush()
        except (OSError, ValueError):
            pass  # console or log closed under us during shutdown: nothing left to copy to

    def finish(self) -> None:
        """End of the pipe (hub thread): close it and the log, release ``join``."""
        try:
            self._source.close()
            if self._log is not None:
                self._log.close()
        except OSError:
            pass
        finally:
            self._done.set()

    def join(self, timeout: float) -> None:
        """Wait (bounded: a grandchild may hold the pipe open) until the pipe is drained."""
        self._done.wait(timeout)


def console_stream(stderr: bool) -> BinaryIO:
    """The launcher's own binary stdout/stderr."""
    stream = sys.stderr if stderr else sys.stdout
    return stream.buffer
