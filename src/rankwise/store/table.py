"""The in-memory key-value table behind ``HashStore`` and the TCP store's server.

Why shared: the atomic semantics (``add`` on decimal text, torch's ``compare_set``,
waiting for several keys) must be identical whether a store lives in this process or
behind a socket, so both use this one class.

Waiting never spins: waiters sleep on a ``threading.Condition`` that every write
notifies, with the remaining time as the bound. ``close`` wakes all of them with
``TableClosed`` so a server shutdown never leaves a client hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import StoreError
from .base import RESERVED_PREFIX
from .protocol import INT64_MAX, INT64_MIN

__all__ = ["KVTable", "TableClosed", "add_to_value", "compare_set_value"]

_T = TypeVar("_T")
_MAX_SLEEP_S = 3600.0  # Condition.wait overflows on huge timeouts; re-check hourly


class TableClosed(StoreError):
    """The table was closed while (or before) a caller used it."""


def add_to_value(current: bytes | None, key: bytes, amount: int) -> tuple[bytes, int]:
    """The new stored bytes and integer after adding ``amount`` to ``current``.

    Values are ASCII decimal like torch's stores; anything else is a ``StoreError``,
    as is a result outside int64 (the TCP protocol carries int64).
    """
    if current is None:
        base = 0
    else:
        try:
            base = int(current.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise StoreError(
                f"add on key {key.decode('utf-8', 'replace')!r}: its value {current[:40]!r} "
                f"is not an integer"
            ) from None
    result = base + amount
    if not INT64_MIN <= result <= INT64_MAX:
        raise StoreError(f"add on key {key.decode('utf-8', 'replace')!r} overflows int64")
    return str(result).encode("ascii"), result


def compare_set_value(current: bytes | None, expected: bytes, desired: bytes) -> bytes | None:
    """What ``compare_set`` should store (``None``: leave it) per torch's semantics."""
    if current is None:
        return desired if expected == b"" else None
    return desired if current == expected else None


class KVTable:
    """A thread-safe dict of bytes with blocking waits."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        #: bound on the keys and values held together (None: unbounded); a store that
        #: anyone may write to must not be able to grow without limit
        self._max_bytes = max_bytes
        self._bytes = 0

    def _put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (lock held), within the total-size bound."""
        old = self._data.get(key)
        size = self._bytes + len(value) - (len(old) if old is not None else -len(key))
        if self._max_bytes is not None and size > self._max_bytes and size > self._bytes:
            raise StoreError(
                f"setting key {key[:80].decode('utf-8', 'replace')!r} ({len(value)} bytes) "
                f"would make the store hold {size} bytes, over its total limit of "
                f"{self._max_bytes} (Limits.max_total_bytes); delete keys no longer needed")
        self._data[key] = value
        self._bytes = size

    def _wait_until(self, ready: Callable[[], _T | None], timeout_s: float) -> _T | None:
        """Wait (holding the lock) until ``ready()`` is not None or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._closed:
                raise TableClosed("the store was shut down")
            result = ready()
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._cond.wait(min(left, _MAX_SLEEP_S))

    def _check_open(self) -> None:
        if self._closed:
            raise TableClosed("the store was shut down")

    def set(self, key: bytes, value: bytes) -> None:
        with self._cond:
            self._check_open()
            self._put(key, value)
            self._cond.notify_all()

    def get(self, key: bytes, timeout_s: float) -> bytes | None:
        with self._cond:
            return self._wait_until(lambda: self._data.get(key), timeout_s)

    def add(self, key: bytes, amount: int) -> int:
        with self._cond:
            self._check_open()
            stored, result = add_to_value(self._data.get(key), key, amount)
            self._put(key, stored)
            self._cond.notify_all()
            return result

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            self._check_open()
            current = self._data.get(key)
            new = compare_set_value(current, expected, desired)
            if new is None:
                return expected if current is None else current
            self._put(key, new)
            self._cond.notify_all()
            return new

    def wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """Keys still missing after up to ``timeout_s`` (empty when all exist)."""
        with self._cond:
            done = self._wait_until(lambda: True if self._all_present(keys) else None, timeout_s)
            if done:
                return []
            return [k for k in keys if k not in self._data]

    def _all_present(self, keys: list[bytes]) -> bool:
        return all(k in self._data for k in keys)

    def check(self, keys: list[bytes]) -> bool:
        with self._cond:
            self._check_open()
            return self._all_present(keys)

    def delete(self, key: bytes) -> bool:
        with self._cond:
            self._check_open()
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(key) + len(old)
            return True

    def num_keys(self) -> int:
        with self._cond:
            self._check_open()
            return sum(1 for k in self._data if not k.startswith(RESERVED_PREFIX))

    def close(self) -> None:
        """Refuse further use and wake every waiter with ``TableClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
