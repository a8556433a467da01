"""A store round in O(n) requests (store/gather.py): rank 0 gathers, the rest read one
blob. Ranks are threads over one in-memory store that counts the requests."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rankwise import HashStore
from rankwise.errors import DistTimeout
from rankwise.store.gather import gather


class _Counting:
    """A HashStore that counts the requests made of it."""

    def __init__(self) -> None:
        self.store = HashStore()
        self.requests = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            with self._lock:
                self.requests += 1
            return method(*args)
        return counted


def _round(store: Any, n: int, digest: Any = None) -> list[str]:
    out: list[str] = [""] * n
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            out[r] = gather(store, "round", f"value-{r}", n, r, 20.0, digest)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not errors, errors
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_every_rank_gets_every_value_in_linear_requests(n: int) -> None:
    store = _Counting()
    blobs = _round(store, n)
    assert len(set(blobs)) == 1 and blobs[0] == str([f"value-{r}" for r in range(n)]).replace(
        "'", '"')
    assert store.requests <= 4 * n + 2, store.requests  # was n * (n + 2)


def test_a_digest_is_what_everyone_reads() -> None:
    blobs = _round(_Counting(), 5, lambda raw: f"{len(raw)} values, first {raw[0].decode()}")
    assert blobs == ["5 values, first value-0"] * 5


def test_a_missing_rank_times_out_on_every_rank_that_came() -> None:
    store = HashStore()
    with pytest.raises(DistTimeout):
        gather(store, "lonely", "v", 2, 0, 0.2)
    with pytest.raises(DistTimeout):
        gather(store, "lonely2", "v", 2, 1, 0.2)
