"""Copy each worker's stdout/stderr to the console (``[rank N] `` prefixed) and/or a log file.

Why threads: a worker's pipe must be drained as fast as it writes or the worker blocks on a
full pipe; one small thread per stream blocks in ``read`` (in the kernel) and costs nothing
while the worker is quiet.  Whole lines are written under one lock so ranks never interleave
mid-line.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, BinaryIO

__all__ = ["StreamPump"]

_console_lock = threading.Lock()


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
        self._prefix = prefix
        self._console = console
        self._log = log
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._source.readline, b""):
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                if self._console is not None:
                    end = b"" if line.endswith(b"\n") else b"\n"
                    with _console_lock:
                        self._console.write(self._prefix + line + end)
                        self._console.flush()
        except (OSError, ValueError):
            pass  # console or log closed under us during shutdown: nothing left to copy to
        finally:
            self._source.close()
            if self._log is not None:
                self._log.close()

    def join(self, timeout: float) -> None:
        """Wait (bounded: a grandchild may hold the pipe open) until the pipe is drained."""
        self._thread.join(timeout)


def console_stream(stderr: bool) -> BinaryIO:
    """The launcher's own binary stdout/stderr."""
    stream = sys.stderr if stderr else sys.stdout
    return stream.buffer
