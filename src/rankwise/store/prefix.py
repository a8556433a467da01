"""``PrefixStore``: a namespace inside another store.

Why: several process groups (and the launcher's own bookkeeping) share one rendezvous
store; giving each a prefix keeps their keys from colliding without a second server.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from ..errors import InvalidArgument
from .base import Store, Watcher, to_seconds

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key ``k`` is stored in ``store`` as ``f"{prefix}/{k}"``.

    Timeout and size limits are those of the wrapped store (changing the timeout here
    changes it there), so a prefix never loosens a bound the underlying store enforces.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise InvalidArgument(f"store must be a Store, got {type(store).__name__}")
        super().__init__(store.timeout, store._limits)
        self._prefix_str = prefix
        self._store = store
        # Nested prefixes compose: keys go to the innermost real store with every prefix
        # in front ("outer/inner/k"). Forwarding to the wrapped PrefixStore's private
        # methods instead would skip its prefix, and two namespaces would collide.
        inner = store if isinstance(store, PrefixStore) else None
        self._base: Store = inner._base if inner is not None else store
        outer: bytes = inner._prefix if inner is not None else b""
        self._prefix: bytes = outer + prefix.encode("utf-8") + b"/"

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix_str

    def auth_failures(self) -> str:
        return self._store.auth_failures()  # server-wide, not namespaced

    def _timeout_seconds(self) -> float:
        return self._base._timeout_seconds()

    def set_watcher(self, watcher: Watcher | None) -> None:
        self._base.set_watcher(watcher)

    def _watching(self) -> Watcher | None:
        return self._base._watching()

    def _blocking(self, step: Callable[[float], bool], timeout_s: float) -> None:
        self._base._blocking(step, timeout_s)  # the real store knows how to watch its waits

    def set_timeout(self, timeout: timedelta | float) -> None:
        self._store.set_timeout(to_seconds(timeout))

    def _key(self, key: object) -> bytes:
        raw = self._prefix + super()._key(key)
        if len(raw) > self._limits.max_key_bytes:
            raise InvalidArgument(
                f"store key with prefix {self._prefix_str!r} is {len(raw)} bytes, over the "
                f"limit of {self._limits.max_key_bytes} bytes"
            )
        return raw

    def _describe(self) -> str:
        return f"PrefixStore({self._prefix_str!r}) over {self._store._describe()}"

    def _set(self, key: bytes, value: bytes) -> None:
        self._base._set(key, value)

    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        return self._base._get(key, timeout_s)

    def _add(self, key: bytes, amount: int) -> int:
        return self._base._add(key, amount)

    def _batch(self, ops: list[tuple[str, list[bytes]]]) -> list[bytes | int | None]:
        return self._base._batch(ops)

    def _batch_then_get(self, ops: list[tuple[str, list[bytes]]], key: bytes,
                        timeout_s: float) -> tuple[list[bytes | int | None], bytes | None]:
        return self._base._batch_then_get(ops, key, timeout_s)

    def _batch_wait_read(self, ops: list[tuple[str, list[bytes]]], keys: list[bytes],
                         timeout_s: float) -> tuple[list[bytes | int | None], list[bytes],
                                                    list[bytes | None]]:
        return self._base._batch_wait_read(ops, keys, timeout_s)

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return self._base._compare_set(key, expected, desired)

    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        return self._base._wait(keys, timeout_s)

    def _check(self, keys: list[bytes]) -> bool:
        return self._base._check(keys)

    def _delete_key(self, key: bytes) -> bool:
        return self._base._delete_key(key)

    def _num_keys(self) -> int:
        # torch counts the whole underlying store too; a per-prefix count would need a
        # key listing the TCP protocol deliberately does not offer.
        return self._base._num_keys()
