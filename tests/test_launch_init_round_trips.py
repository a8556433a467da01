"""Serial store round trips of init's rendezvous and last step, counted in-process.

Why counted, not timed: on a slow link (300 ms each way) init costs about one round trip
per serial store request; ``Store.batch`` sends several as one. Ranks are threads sharing a
``HashStore`` that counts, per thread, the requests a network store would wait for.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from rankwise.api.init_done import wait_all_initialized
from rankwise.api.rendezvous import rendezvous as _rendezvous
from rankwise.errors import InvalidArgument
from rankwise.store import HashStore, PrefixStore

pytestmark = pytest.mark.timeout(60)


class _CountingStore(HashStore):
    """A round trip per primitive request, and one per batch (not per request in it), as
    ``TCPStore`` pipelines them: a batch, a batch with a blocking get, a batch with a wait
    on several keys and their reads."""

    def __init__(self) -> None:
        super().__init__()
        self.trips: Counter[int] = Counter()
        self._in_batch = threading.local()

    def _count(self) -> None:
        if not getattr(self._in_batch, "on", False):
            self.trips[threading.get_ident()] += 1

    def _one_trip(self, call: Any) -> Any:
        self._count()
        outer, self._in_batch.on = getattr(self._in_batch, "on", False), True
        try:
            return call()
        finally:
            self._in_batch.on = outer

    def _batch(self, ops: list[tuple[str, list[bytes]]]) -> list[bytes | int | None]:
        return self._one_trip(lambda: super(_CountingStore, self)._batch(ops))  # type: ignore[no-any-return]

    def _batch_then_get(self, ops: list[tuple[str, list[bytes]]], key: bytes,
                        timeout_s: float) -> Any:
        return self._one_trip(lambda: super(_CountingStore, self)._batch_then_get(
            ops, key, timeout_s))

    def _batch_wait_read(self, ops: list[tuple[str, list[bytes]]], keys: list[bytes],
                         timeout_s: float) -> Any:
        return self._one_trip(lambda: super(_CountingStore, self)._batch_wait_read(
            ops, keys, timeout_s))


for _name in ("_set", "_get", "_add", "_compare_set", "_wait", "_check"):
    def _counted(self: _CountingStore, *args: Any, _name: str = _name) -> Any:
        self._count()
        return getattr(HashStore, _name)(self, *args)
    setattr(_CountingStore, _name, _counted)


@pytest.mark.parametrize("rank_hosts", [False, True], ids=["launcher-hosts", "rank0-hosts"])
def test_init_rendezvous_and_last_step_take_few_serial_round_trips(rank_hosts: bool) -> None:
    """Before batching: 11 per rank in the rendezvous (9 requests, a wait and a read; the
    last rank to join N + 1 more to read the addresses) and 5-6 in the last step; then 3
    (5 for the last: it read the addresses, set the verdict and waited for it) and 3-4.
    Now the last to join takes 4 (its verdict is the one it set), and when no rank hosts
    the store (a launcher does) the last step takes 2: nobody holds the store for the
    others, so they do not count themselves in."""
    store = _CountingStore()
    store.set_watcher(lambda err: None)  # "watched": ranks but 0 look for ended peers rarely
    n = 3
    trips: dict[int, tuple[int, int]] = {}

    def rank(r: int) -> None:
        scoped = PrefixStore("rankwise/0", store)
        me = threading.get_ident()
        hosting = rank_hosts and r == 0
        got = _rendezvous(scoped, r, n, 30.0, hosting=hosting,
                          address=f"127.0.0.1:{1000 + r} 1")
        assert got.hosted == rank_hosts
        joined = store.trips[me]
        comm = SimpleNamespace(rank=r, world_size=n, router=SimpleNamespace(failure=None))
        wait_all_initialized(scoped, comm, 30.0, hosting=hosting, held=got.hosted)
        trips[r] = (joined, store.trips[me] - joined)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(trips) == n, trips
    # rank 0 also looks for ended peers every 0.5 s while it waits: not counted here
    joined = sorted(trips[r][0] for r in range(1, n))
    assert joined[:-1] == [3] * (n - 2), trips
    assert joined[-1] <= 4, trips  # the last to join reads every address and sets the verdict
    assert all(trips[r][1] <= (4 if rank_hosts else 2) for r in range(1, n)), trips


def test_a_batch_is_one_round_trip_on_a_tcp_store() -> None:
    """``Store.batch`` and ``read_many`` over a real server: results in order, one round
    trip (``round_trips``) for the lot, the namespace of a ``PrefixStore`` kept."""
    from rankwise.store import TCPStore
    from rankwise.store.tcp import requests_sent, round_trips

    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10.0) as master:
        store = PrefixStore("ns", master)
        trips, sent = round_trips(), requests_sent()
        got = store.batch([("set", "a", "1"), ("add", "n", 5), ("compare_set", "c", "", "x"),
                           ("compare_set", "c", "", "y")])
        assert (round_trips() - trips, requests_sent() - sent) == (1, 4)
        assert got == [None, 5, b"x", b"x"]
        assert store.read_many(["a", "missing", "c"]) == [b"1", None, b"x"]
        assert master.get("ns/a") == b"1" and not master.check(["missing"])
        with pytest.raises(InvalidArgument):
            store.batch([("delete", "a")])
        trips = round_trips()
        assert store.batch_then_wait_get([("set", "v/1", "x")], "a", 5.0) == ([None], b"1")
        assert store.batch_then_wait_get([("add", "n", 1)], "never", 0.05) == ([6], None)
        assert round_trips() - trips == 2  # one each: the batch and the get in one write


def test_the_rendezvous_hands_every_rank_all_host_identities() -> None:
    """The engine choice's host round rides on the rendezvous (one round trip fewer on a
    slow link): every rank gets every rank's ``host_identity()``, in rank order."""
    from rankwise.shmem.host import host_identity

    store = _CountingStore()
    n = 3
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        got[r] = _rendezvous(PrefixStore("rankwise/0", store), r, n, 30.0,
                             address=f"127.0.0.1:{1000 + r} 1")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(n)), got
    assert all(j.hosts == [host_identity()] * n for j in got.values()), got
    assert all(j.blob is not None and j.blob.count("\n") == n - 1 for j in got.values()), got


def _open_segments(store: Any, nranks: int) -> dict[int, int]:
    """Each rank's round trips in ``open_segment`` (ranks are threads)."""
    from rankwise.shmem.layout import Layout
    from rankwise.shmem.segment import open_segment

    trips: dict[int, int] = {}

    def rank(r: int) -> None:
        me = threading.get_ident()
        before = store.trips[me]
        seg = open_segment(store, "seg", r, nranks, slot_bytes=65536, method="memfd",
                           timeout=20.0, kind=Layout)
        trips[r] = store.trips[me] - before
        seg.mm.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return trips


@pytest.mark.parametrize("nranks", [2, 4])
def test_shared_memory_setup_takes_two_round_trips_per_rank(nranks: int) -> None:
    """Before: rank 0 set, waited, read each answer and set the verdict (3 + n - 1); each
    peer waited and read the description, set its answer, waited and read the verdict
    (5). Now 2 each: the description out with every answer back, and the answer out with
    the verdict back."""
    trips = _open_segments(_CountingStore(), nranks)
    assert trips == {r: 2 for r in range(nranks)}, trips


def test_a_batch_then_a_wait_on_several_keys_is_one_round_trip_on_a_tcp_store() -> None:
    """``batch_then_wait_read`` over a real server: the batch's results, then every waited
    key's value once all are set (None at the timeout), in one round trip each."""
    from rankwise.store import TCPStore
    from rankwise.store.tcp import round_trips

    with TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10)) as master, \
            TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10)) as other:
        store = PrefixStore("ns", master)
        late = threading.Timer(0.2, lambda: other.set("ns/b", "2"))
        late.start()
        trips = round_trips()
        got = store.batch_then_wait_read([("set", "a", "1"), ("add", "n", 2)], ["a", "b"], 5.0)
        late.join()
        assert got == ([None, 2], [b"1", b"2"])
        assert store.batch_then_wait_read([], ["a", "never"], 0.05) == ([], None)
        assert round_trips() - trips == 3  # one each, and the other client's set
        assert store.batch_then_wait_read([("add", "n", 1)], ["b"], 1.0) == ([3], [b"2"])


def test_the_launchers_rendezvous_takes_five_round_trips() -> None:
    """Each launcher's rendezvous (``launch.rendezvous``) on a fixed-size job: before, 6
    (the job, the claim, the arrival, its entry, the wait for "closed", the entries);
    now 5, its entry going out with the first look at "closed". Launchers are threads."""
    from rankwise.launch.rendezvous import NodeInfo, rendezvous

    store = _CountingStore()
    trips: dict[int, int] = {}
    ranks: dict[int, int] = {}

    def node(r: int) -> None:
        me = threading.get_ident()
        ranks[r] = rendezvous(store, NodeInfo(host=f"h{r}", pid=r, nproc=2, node_rank=r,
                                              min_nodes=2, max_nodes=2, rdzv_id="x"),
                              20.0).node_rank
        trips[r] = store.trips[me]

    threads = [threading.Thread(target=node, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ranks == {0: 0, 1: 1}
    assert trips == {0: 5, 1: 5}, trips


def test_the_token_proof_goes_with_the_first_request_and_still_guards_both_sides() -> None:
    """``prove_with_first_request`` (init's store): the connection is ready after the
    first exchange of the handshake, the proof travels with the first request (a round
    trip less). A wrong token is still refused, and the server carried out nothing of
    what came with the refused proof."""
    from rankwise.errors import AuthError
    from rankwise.store import TCPStore

    ten = timedelta(seconds=10)
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=ten, token="right") as master:
        with TCPStore("127.0.0.1", master.port, timeout=ten, token="wrong",
                      prove_with_first_request=True) as intruder, \
                pytest.raises(AuthError, match="rejected our token"):
            intruder.set("planted", "x")
        assert not master.check(["planted"])
        with TCPStore("127.0.0.1", master.port, timeout=ten, token="right",
                      prove_with_first_request=True) as client:
            client.set("k", "v")
            assert master.get("k") == b"v" and client.get("k") == b"v"


def test_a_server_that_cannot_prove_the_token_is_not_believed() -> None:
    """With the proof sent ahead, the client still reads the server's proof before any
    reply: a listener that says "ok" without knowing the token gets an ``AuthError``,
    not its forged answer trusted."""
    import socket

    from rankwise.errors import AuthError
    from rankwise.store import TCPStore
    from rankwise.wire import auth

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            auth.recv_exact(conn, len(auth._MAGIC) + 1 + len(b"store") + 1 + auth._NONCE, "")
            conn.sendall(auth._MAGIC + bytes([0]) + bytes(auth._NONCE))
            auth.recv_exact(conn, auth._MAC, "")  # the proof (and the request behind it)
            conn.sendall(bytes([0]) + bytes(auth._MAC) + b"forged reply")
            conn.recv(1)  # until the client hangs up

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5), token="t",
                      prove_with_first_request=True) as client, \
                pytest.raises(AuthError, match="could not prove"):
            client.get("anything")
    finally:
        listener.close()
        thread.join(5)
