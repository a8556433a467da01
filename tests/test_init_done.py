"""The last step of init: every rank waits for all; a peer that ended meanwhile is named.

In process: ranks are threads sharing a ``HashStore``; the launcher's report of an ended
rank is the two keys it writes (``exited/count``, ``exited/<rank>``).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from rankwise.api.init_done import wait_all_initialized
from rankwise.errors import PeerFailure, StoreError
from rankwise.store import HashStore

pytestmark = pytest.mark.timeout(60)


def _comm(rank: int, world_size: int) -> Any:
    return SimpleNamespace(rank=rank, world_size=world_size,
                           router=SimpleNamespace(failure=None))


def _watched_store() -> HashStore:
    store = HashStore()

    def watch(err: StoreError | None) -> None:
        return None  # nothing fails here: it only makes the store "watched"
    store.set_watcher(watch)
    return store


def _run(store: HashStore, ranks: list[int], world_size: int) -> dict[int, BaseException | None]:
    out: dict[int, BaseException | None] = {}

    def one(rank: int) -> None:
        try:
            wait_all_initialized(store, _comm(rank, world_size), 30.0)
            out[rank] = None
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    return out


def test_every_rank_returns_once_all_got_there() -> None:
    assert _run(_watched_store(), [0, 1, 2], 3) == {0: None, 1: None, 2: None}


def test_a_rank_that_ended_is_named_on_every_rank_at_rank_0s_pace() -> None:
    # rank 2 ended before it got there; rank 1 looks only every 10 s itself, so it is rank
    # 0's verdict in ``init/all`` that ends its wait (the test's 60 s bound would not
    # tell the two apart, so the verdict is checked too)
    store = _watched_store()
    store.set("exited/2", "exited with code 3")
    store.add("exited/count", 1)
    out = _run(store, [0, 1], 3)
    for rank in (0, 1):
        err = out[rank]
        assert isinstance(err, PeerFailure), err
        assert f"rank {rank}: rank 2 exited with code 3 before it finished" in str(err)
    assert store.get("init/all") == b"2 exited with code 3"
