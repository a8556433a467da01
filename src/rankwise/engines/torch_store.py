"""A torch.distributed ``Store`` over a rankwise store, so a torch process group can be
built from rankwise's own rendezvous (no second port for the user to choose)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as tdist

__all__ = ["TorchStore"]


class TorchStore(tdist.Store):  # type: ignore[misc,name-defined]
    """torch's Store interface forwarded to a rankwise (prefix) store."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, bytes(value) if not isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        def b(v: Any) -> bytes | str:
            return v if isinstance(v, str) else bytes(v)
        return bytes(self.inner.compare_set(key, b(expected), b(desired)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())
