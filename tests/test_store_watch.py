"""A watched blocking call on the TCP store: one parked request, the watcher asked locally.

Why it matters: the watcher used to be asked between 0.25 s server round trips, so every
rank waiting in init sent four requests a second and the store's load grew with N x wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from rankwise.errors import DistError, PeerFailure, StoreError
from rankwise.store import PrefixStore, TCPStore, TCPStoreServer
from rankwise.store.tcp import requests_sent

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer("127.0.0.1", 0) as srv:
        yield srv


class _Failing:
    """A watcher that reports a peer's failure on its ``after``-th look."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.looks: list[StoreError | None] = []

    def __call__(self, err: StoreError | None) -> None:
        self.looks.append(err)
        if len(self.looks) >= self.after:
            raise PeerFailure("rank 3 failed: boom")


def test_a_long_watched_get_is_one_request_and_hears_the_watcher(
        server: TCPStoreServer) -> None:
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
    watch = _Failing(after=4)  # about a second of waiting
    store.set_watcher(watch)
    before = requests_sent()
    with pytest.raises(PeerFailure, match="rank 3 failed"):
        store.get("never")
    assert requests_sent() - before == 1
    assert watch.looks == [None] * 4
    # the parked request was abandoned with its connection: the store still works
    store.set_watcher(None)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()


def test_a_watched_wait_through_a_prefix_completes_when_another_client_sets(
        server: TCPStoreServer) -> None:
    waiter = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
    setter = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
    setter_sets = _SetOnLook(setter, "job/ready")
    waiter.set_watcher(setter_sets)
    before = requests_sent()
    PrefixStore("job", waiter).wait(["ready"])
    assert requests_sent() - before == 2  # the wait, and the setter's set
    assert setter_sets.looks >= 1
    waiter.close()
    setter.close()


class _SetOnLook:
    """A watcher whose first look has another client set the awaited key."""

    def __init__(self, setter: TCPStore, key: str) -> None:
        self.setter, self.key, self.looks = setter, key, 0

    def __call__(self, err: StoreError | None) -> None:
        assert err is None
        self.looks += 1
        if self.looks == 1:
            self.setter.set(self.key, b"1")


def test_the_watcher_sees_the_store_going_away() -> None:
    server = TCPStoreServer("127.0.0.1", 0).start()
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
    seen: list[StoreError | None] = []

    def watch(err: StoreError | None) -> None:
        seen.append(err)
        if err is None and len(seen) == 2:
            server.close()  # wakes the parked get with "went away"

    store.set_watcher(watch)
    with pytest.raises(DistError, match="went away|lost the connection"):
        store.get("never")
    assert isinstance(seen[-1], StoreError)
    store.close()
