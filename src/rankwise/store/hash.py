"""``HashStore``: an in-process store for tests and single-process jobs."""

from __future__ import annotations

from datetime import timedelta

from .base import DEFAULT_TIMEOUT, Store
from .protocol import DEFAULT_LIMITS, Limits
from .table import KVTable

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe in-memory store; threads of one process share it directly.

    It applies the same limits and semantics as the TCP store (both use ``KVTable``),
    so code tested against it behaves the same over the network.
    """

    def __init__(
        self, timeout: timedelta | float = DEFAULT_TIMEOUT, limits: Limits = DEFAULT_LIMITS
    ):
        super().__init__(timeout, limits)
        self._table = KVTable()

    def _set(self, key: bytes, value: bytes) -> None:
        self._table.set(key, value)

    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        return self._table.get(key, timeout_s)

    def _add(self, key: bytes, amount: int) -> int:
        return self._table.add(key, amount)

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return self._table.compare_set(key, expected, desired)

    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        return self._table.wait(keys, timeout_s)

    def _check(self, keys: list[bytes]) -> bool:
        return self._table.check(keys)

    def _delete_key(self, key: bytes) -> bool:
        return self._table.delete(key)

    def _num_keys(self) -> int:
        return self._table.num_keys()
