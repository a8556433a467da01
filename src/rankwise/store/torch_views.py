"""The two store adapters between torch.distributed and rankwise (imports torch: only
torch-facing code imports this module).

Why two directions: under ``rankwise run`` the rendezvous store is rankwise's (the launcher
hosts it on ``MASTER_PORT``), so torch's own rendezvous must see it as a torch ``Store``
(:class:`TorchStoreView`); under torchrun (or ``init_method="tcp://..."``) the store is
torch's, and rankwise's rendezvous, mesh set-up and engine agreement must run on it
(:class:`RankwiseStoreView`). The torch engines build their torch process groups over a
``TorchStoreView`` of the group's rankwise store too. Both are thin: keys and values pass
through unchanged, and the only translation is of timeouts and errors.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import PrefixStore
from torch._C._distributed_c10d import Store as _TorchStore

from ..errors import StoreError
from .base import Store

__all__ = ["RankwiseStoreView", "TorchStoreView", "rankwise_store_under"]

#: torch reads a zero timedelta as "no timeout"; a zero-second rankwise wait means "poll"
_POLL = timedelta(milliseconds=1)


class TorchStoreView(_TorchStore):
    """torch's ``Store`` interface over a rankwise store."""

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner = inner
        self._clones: list[TorchStoreView] = []

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        def raw(v: Any) -> bytes | str:
            return v if isinstance(v, str) else bytes(v)
        return self.inner.compare_set(key, raw(expected), raw(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> TorchStoreView:
        """Another view of the same store (the store is thread-safe): torch clones a
        group's store for gloo's ``split_group``, which failed here with "pure virtual
        function c10d::Store::clone". Kept alive with this one, since torch keeps only
        the C++ half of what Python returns."""
        twin = TorchStoreView(self.inner)
        self._clones.append(twin)
        return twin


def rankwise_store_under(store: Any) -> Store | None:
    """The rankwise store at the bottom of torch's ``PrefixStore`` chain, if there is one.

    torch scopes the store it hands to a backend (``"<group>/"`` prefixes); rankwise's own
    rendezvous wants the unscoped launcher store, whose ``rankwise/<attempt>/exited/<rank>``
    keys tell waiting ranks at once that a peer died before the group formed."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store.inner if isinstance(store, TorchStoreView) else None


class RankwiseStoreView(Store):
    """rankwise's ``Store`` over a torch store (torchrun's TCPStore, a FileStore, ...)."""

    def __init__(self, inner: Any, timeout: timedelta) -> None:
        super().__init__(timeout)
        self.inner = inner

    def _describe(self) -> str:
        return f"torch {type(self.inner).__name__}"

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
            raise StoreError(f"{what} on {self._describe()} failed: {exc}") from exc

    def _set(self, key: bytes, value: bytes) -> None:
        name = key.decode()
        self._call("set", self.inner.set, name, value)
        # torch's TCPStore client sends a set without waiting for a reply, so another
        # client could still miss the key; rankwise's set is visible once it returns, so
        # one round trip on the same connection follows (the server answers in order)
        self._check_one(name)

    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        if self._wait([key], timeout_s):
            return None
        return bytes(self._call("get", self.inner.get, key.decode()))

    def _add(self, key: bytes, amount: int) -> int:
        name = key.decode()
        # torch's TCPStore server drops the connection on ``add`` to a non-integer value
        # (every later call then fails); refuse that here, with rankwise's wording
        if self._check_one(name):
            current = bytes(self._call("get", self.inner.get, name))
            if not current.strip().lstrip(b"-").isdigit():
                raise StoreError(f"add({name!r}): the value {current[:40]!r} is not an integer")
        return int(self._call("add", self.inner.add, name, amount))

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._call("compare_set", self.inner.compare_set, key.decode(), expected,
                                desired))

    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        names = [k.decode() for k in keys]
        try:
            self.inner.wait(names, max(timedelta(seconds=timeout_s), _POLL))
            return []
        except RuntimeError:  # torch words a timeout and a lost store alike; ask which
            return [k for k, n in zip(keys, names, strict=True) if not self._check_one(n)]

    def _check_one(self, name: str) -> bool:
        return bool(self._call("check", self.inner.check, [name]))

    def _check(self, keys: list[bytes]) -> bool:
        return bool(self._call("check", self.inner.check, [k.decode() for k in keys]))

    def _delete_key(self, key: bytes) -> bool:
        return bool(self._call("delete_key", self.inner.delete_key, key.decode()))

    def _num_keys(self) -> int:
        return int(self._call("num_keys", self.inner.num_keys))
