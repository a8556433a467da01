"""Behaviour every store shares (HashStore, FileStore, TCPStore, PrefixStore), plus
multi-process atomicity of the two stores that cross process boundaries."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from rankwise.errors import DistError, DistTimeout, InvalidArgument, StoreError
from rankwise.store import (
    FileStore,
    HashStore,
    Limits,
    PrefixStore,
    Store,
    TCPStore,
)

pytestmark = pytest.mark.timeout(60)

KINDS = ["hash", "file", "tcp", "prefix", "torch"]
Pair = tuple[Store, Store]


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    """Two handles onto one store (for HashStore: the same object, shared by threads)."""
    kind = request.param
    timeout = timedelta(seconds=10)
    stores: list[Store]
    if kind == "hash":
        h = HashStore(timeout)
        stores = [h, h]
    elif kind == "torch":  # rankwise's view of a torch store (rankwise.torch under torchrun)
        tdist = pytest.importorskip("torch.distributed")
        from rankwise.store.torch_views import RankwiseStoreView

        master_t = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
        client_t = tdist.TCPStore("127.0.0.1", master_t.port, timeout=timeout)
        stores = [RankwiseStoreView(master_t, timeout), RankwiseStoreView(client_t, timeout)]
    elif kind == "file":
        path = str(tmp_path / "store")
        stores = [FileStore(path, timeout=timeout), FileStore(path, timeout=timeout)]
    else:
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
        client = TCPStore("127.0.0.1", master.port, timeout=timeout)
        stores = [master, client]
        if kind == "prefix":
            stores = [PrefixStore("pg0", master), PrefixStore("pg0", client)]
    yield stores[0], stores[1]
    for s in reversed(stores):
        s.close()
    if kind == "prefix":
        client.close()
        master.close()


def test_set_get_roundtrip_str_and_bytes(pair: Pair) -> None:
    a, b = pair
    a.set("k", "välue")
    a.set("raw", b"\x00\xff")
    assert b.get("k") == "välue".encode()
    assert b.get("raw") == b"\x00\xff"
    a.set("k", b"")  # overwrite, empty values are values
    assert b.get("k") == b""


def test_add_counts_and_stores_decimal(pair: Pair) -> None:
    a, b = pair
    assert a.add("n", 5) == 5
    assert b.add("n", -2) == 3
    assert a.get("n") == b"3"
    b.set("text", "abc")
    with pytest.raises(StoreError, match="not an integer"):
        a.add("text", 1)


def test_compare_set_follows_torch(pair: Pair) -> None:
    a, b = pair
    assert a.compare_set("c", "", "first") == b"first"  # missing + empty expected: set
    assert b.compare_set("c", "wrong", "x") == b"first"  # mismatch: current value
    assert b.compare_set("c", "first", "second") == b"second"
    assert a.get("c") == b"second"
    assert a.compare_set("absent", "exp", "new") == b"exp"  # missing + non-empty: no set
    assert not a.check(["absent"])


def test_check_delete_num_keys(pair: Pair) -> None:
    a, b = pair
    assert a.num_keys() == 0
    a.set("x", "1")
    b.set("y", "2")
    assert a.check(["x", "y"]) and not a.check(["x", "z"]) and a.check([])
    assert b.num_keys() == 2
    assert b.delete_key("x") is True
    assert a.delete_key("x") is False
    assert a.num_keys() == 1
    assert not b.check(["x"])


def test_blocking_get_released_by_set_from_other_thread(pair: Pair) -> None:
    a, b = pair
    got: list[bytes] = []
    done = threading.Event()

    def getter() -> None:
        got.append(b.get("late"))
        done.set()

    t = threading.Thread(target=getter, daemon=True)
    t.start()
    assert not done.wait(0.1), "get returned before the key was set"
    a.set("late", "here")
    assert done.wait(5)
    t.join(5)
    assert got == [b"here"]


def test_get_timeout_names_key_and_store_stays_usable(pair: Pair) -> None:
    a, b = pair
    b.set_timeout(timedelta(milliseconds=200))
    start = time.monotonic()
    with pytest.raises(DistTimeout, match=r"get\('never'\).*0\.2s"):
        b.get("never")
    assert time.monotonic() - start < 3
    a.set("after", "ok")
    assert b.get("after") == b"ok"


def test_wait_names_missing_keys(pair: Pair) -> None:
    a, b = pair
    a.set("k1", "v")
    b.wait(["k1"], timedelta(seconds=1))
    with pytest.raises(DistTimeout) as info:
        b.wait(["k1", "k2", "k3"], 0.2)
    msg = str(info.value)
    assert "2 of 3 keys" in msg and "k2" in msg and "k3" in msg and "'k1'" not in msg


def test_wait_released_by_later_sets(pair: Pair) -> None:
    a, b = pair
    errors: list[DistError] = []

    def waiter() -> None:
        try:
            b.wait(["w1", "w2"], timedelta(seconds=5))
        except DistError as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    a.set("w1", "1")
    a.set("w2", "2")
    t.join(5)
    assert not t.is_alive() and errors == []


def test_bad_arguments_raise_invalid_argument(pair: Pair) -> None:
    a, _ = pair
    bad_calls: list[Callable[[], object]] = [
        lambda: a.set(b"bytes-key", "v"),  # type: ignore[arg-type]
        lambda: a.set("k", 3),  # type: ignore[arg-type]
        lambda: a.add("k", 1.5),  # type: ignore[arg-type]
        lambda: a.add("k", True),
        lambda: a.add("k", 2**63),
        lambda: a.wait("single-string"),  # type: ignore[arg-type]
        lambda: a.wait(["k"], timeout=-1),
        lambda: a.wait(["k"], timeout=float("inf")),
        lambda: a.set("\x00reserved", "v"),
        lambda: a.set("k" * 5000, "v"),
        lambda: a.set_timeout("soon"),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgument):
            call()
    assert a.timeout == timedelta(seconds=10)


def test_prefix_store_namespaces_keys() -> None:
    inner = HashStore(timedelta(seconds=1))
    p = PrefixStore("job", inner)
    p.set("k", "v")
    assert inner.get("job/k") == b"v"
    assert not inner.check(["k"])
    assert PrefixStore("other", inner).check(["k"]) is False
    p.set_timeout(timedelta(seconds=3))
    assert inner.timeout == timedelta(seconds=3) == p.timeout


def test_nested_prefix_stores_compose_their_prefixes() -> None:
    """A PrefixStore over a PrefixStore keeps both prefixes: "outer/inner/k". Dropping
    the outer one made two jobs' namespaces collide (a second init in one process saw
    its own earlier rank claim)."""
    base = HashStore(timedelta(seconds=1))
    outer = PrefixStore("outer", base)
    inner = PrefixStore("inner", outer)
    inner.set("k", "v")
    assert base.get("outer/inner/k") == b"v"
    assert not base.check(["inner/k"])
    assert outer.get("inner/k") == b"v"
    assert inner.add("n", 2) == 2 and base.add("outer/inner/n", 0) == 2
    assert inner.compare_set("c", "", "x") == b"x" and base.get("outer/inner/c") == b"x"
    inner.wait(["k"], timedelta(seconds=1))
    assert inner.check(["k"]) and not PrefixStore("other", outer).check(["k"])
    assert inner.delete_key("k") and not base.check(["outer/inner/k"])
    assert inner.underlying_store is outer


def test_value_limit_is_checked_before_io() -> None:
    store = HashStore(limits=Limits(max_value_bytes=16))
    with pytest.raises(InvalidArgument, match="exceeds the limit of 16"):
        store.set("k", b"x" * 17)
    with pytest.raises(InvalidArgument):
        store.compare_set("k", "", b"x" * 17)
    store.set("k", b"x" * 16)


def test_file_store_last_of_world_size_removes_file(tmp_path: Path) -> None:
    path = tmp_path / "fs"
    first, second = FileStore(str(path), world_size=2), FileStore(str(path), world_size=2)
    first.set("k", "v")
    first.close()
    assert path.exists() and second.get("k") == b"v"
    second.close()
    assert not path.exists()
    with pytest.raises(StoreError, match="closed"):
        second.get("k")


# --------------------------------------------------------------- multi-process
ADDS_PER_PROC = 200
NPROCS = 4


def _adder(kind: str, where: str, index: int) -> None:
    """Child process: wait for the go signal, add, report done."""
    if kind == "tcp":
        host, port = where.rsplit(":", 1)
        store: Store = TCPStore(host, int(port), timeout=timedelta(seconds=20))
    else:
        store = FileStore(where, timeout=timedelta(seconds=20))
    store.get("go")  # blocks until the parent (another process) sets it
    for _ in range(ADDS_PER_PROC):
        store.add("counter", 1)
    store.set(f"done{index}", "1")
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "file"])
@pytest.mark.procs
def test_add_is_atomic_across_processes(kind: str, tmp_path: Path) -> None:
    parent: Store
    if kind == "tcp":
        parent = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
        where = f"127.0.0.1:{parent.port}"
    else:
        where = str(tmp_path / "fs")
        parent = FileStore(where, timeout=timedelta(seconds=20))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_adder, args=(kind, where, i), daemon=True) for i in range(NPROCS)]
    try:
        for p in procs:
            p.start()
        parent.set("go", "1")
        parent.wait([f"done{i}" for i in range(NPROCS)], timedelta(seconds=40))
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert parent.get("counter") == str(NPROCS * ADDS_PER_PROC).encode()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        parent.close()
