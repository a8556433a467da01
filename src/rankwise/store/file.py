"""``FileStore``: a store in one file, shared by the processes of one machine.

Design (for ``init_method="file:///path"``):

* The file is an **append-only log** of records ``op:u8 keylen:u32 vallen:u32 key
  value`` with ``op`` 1 = set, 2 = delete. The current table is the log replayed; each
  ``FileStore`` object keeps its replay and the byte offset it has read up to, so a
  call reads only what other processes appended since.
* Writers take an exclusive ``fcntl.flock`` and append a whole record with one
  ``write`` on an ``O_APPEND`` descriptor; readers take a shared lock. Read-modify-write
  operations (``add``, ``compare_set``, ``delete_key``) replay and append under one
  exclusive lock, which is what makes them atomic across processes.
* A ``threading.Lock`` serialises threads of one process, because ``flock`` locks belong
  to the open file and do not exclude threads sharing it.
* ``get``/``wait`` poll: they check the file and, while keys are missing, sleep with
  backoff from 1 ms up to 10 ms, never past the timeout. Files offer no portable
  change notification, and 10 ms is well below rendezvous time scales.
* Records are bounds-checked like network frames (the size limits of the store), so a
  corrupted or foreign file raises ``StoreError`` instead of allocating wildly.
* With ``world_size``, each instance counts itself out in ``close()`` and the last of
  ``world_size`` removes the file, like torch's FileStore. The log is never compacted:
  rendezvous writes a few records per rank, far below any size that would matter.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

from ..errors import InvalidArgument, StoreError
from .base import DEFAULT_TIMEOUT, Store
from .protocol import DEFAULT_LIMITS, Limits
from .table import add_to_value, compare_set_value

__all__ = ["FileStore"]

_T = TypeVar("_T")
_RECORD = struct.Struct("!BII")
_SET, _DELETE = 1, 2
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.010
_DONE_KEY = b"\x00rankwise/filestore/closed"


class FileStore(Store):
    """A store backed by ``file_name``; every process opening the same path shares it."""

    def __init__(
        self,
        file_name: str,
        world_size: int | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        *,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(timeout, limits)
        if not isinstance(file_name, (str, os.PathLike)) or not os.fspath(file_name):
            raise InvalidArgument(f"file_name must be a non-empty path, got {file_name!r}")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise InvalidArgument(f"world_size must be a positive int or None, got {world_size!r}")
        self._path = os.fspath(file_name)
        self._world_size = world_size
        try:
            self._fd: int | None = os.open(
                self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise StoreError(f"cannot open the FileStore file {self._path!r}: {exc}") from exc
        # Closes the descriptor if the store is garbage-collected without close().
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        self._lock = threading.Lock()
        self._data: dict[bytes, bytes] = {}
        self._offset = 0

    @property
    def path(self) -> str:
        return self._path

    def _describe(self) -> str:
        return f"FileStore({self._path!r})"

    # ---------------------------------------------------------------- log access
    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Hold the thread lock and a shared/exclusive file lock; yields the fd."""
        with self._lock:
            fd = self._fd
            if fd is None:
                raise StoreError(f"{self._describe()} is closed")
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._refresh(fd)
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _refresh(self, fd: int) -> None:
        """Replay the records appended since our last read."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # the file was replaced or truncated: start over
            self._data.clear()
            self._offset = 0
        if size == self._offset:
            return
        blob = os.pread(fd, size - self._offset, self._offset)
        pos = 0
        while len(blob) - pos >= _RECORD.size:
            op, klen, vlen = _RECORD.unpack_from(blob, pos)
            if (
                op not in (_SET, _DELETE)
                or klen > self._limits.max_key_bytes
                or (vlen > self._limits.max_value_bytes)
            ):
                raise StoreError(
                    f"{self._describe()}: corrupt record at byte {self._offset + pos}; is the "
                    f"file shared with something that is not a rankwise FileStore?"
                )
            end = pos + _RECORD.size + klen + vlen
            if end > len(blob):
                break  # incomplete tail; cannot happen under the lock, but never misparse
            key = blob[pos + _RECORD.size : pos + _RECORD.size + klen]
            if op == _SET:
                self._data[key] = blob[pos + _RECORD.size + klen : end]
            else:
                self._data.pop(key, None)
            pos = end
        self._offset += pos

    def _append(self, fd: int, op: int, key: bytes, value: bytes = b"") -> None:
        record = _RECORD.pack(op, len(key), len(value)) + key + value
        written = os.write(fd, record)
        if written != len(record):
            raise StoreError(f"{self._describe()}: short write ({written} of {len(record)} bytes)")
        self._offset += len(record)  # our own record: no need to read it back
        if op == _SET:
            self._data[key] = value
        else:
            self._data.pop(key, None)

    def _poll(self, probe: Callable[[], _T | None], timeout_s: float) -> _T | None:
        """Call ``probe`` under a shared lock until it returns non-None or time is up."""
        deadline = time.monotonic() + timeout_s
        delay = _POLL_MIN_S
        while True:
            with self._locked(exclusive=False):
                result = probe()
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))  # no change notification on files: back off
            delay = min(delay * 2, _POLL_MAX_S)

    # ---------------------------------------------------------------- primitives
    def _set(self, key: bytes, value: bytes) -> None:
        with self._locked(exclusive=True) as fd:
            self._append(fd, _SET, key, value)

    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        return self._poll(lambda: self._data.get(key), timeout_s)

    def _add(self, key: bytes, amount: int) -> int:
        with self._locked(exclusive=True) as fd:
            stored, result = add_to_value(self._data.get(key), key, amount)
            self._append(fd, _SET, key, stored)
            return result

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self._locked(exclusive=True) as fd:
            current = self._data.get(key)
            new = compare_set_value(current, expected, desired)
            if new is None:
                return expected if current is None else current
            self._append(fd, _SET, key, new)
            return new

    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        if self._poll(lambda: True if all(k in self._data for k in keys) else None, timeout_s):
            return []
        with self._locked(exclusive=False):
            return [k for k in keys if k not in self._data]

    def _check(self, keys: list[bytes]) -> bool:
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def _delete_key(self, key: bytes) -> bool:
        with self._locked(exclusive=True) as fd:
            if key not in self._data:
                return False
            self._append(fd, _DELETE, key)
            return True

    def _num_keys(self) -> int:
        with self._locked(exclusive=False):
            return sum(1 for k in self._data if not k.startswith(b"\x00"))

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the file; with ``world_size``, the last of them deletes it."""
        if self._fd is None:
            return
        if self._world_size is not None:
            with self._locked(exclusive=True) as fd:
                stored, closed = add_to_value(self._data.get(_DONE_KEY), _DONE_KEY, 1)
                self._append(fd, _SET, _DONE_KEY, stored)
                if closed >= self._world_size:
                    try:
                        os.unlink(self._path)
                    except FileNotFoundError:
                        pass
        with self._lock:
            if self._fd is not None:
                self._finalizer()
                self._fd = None
