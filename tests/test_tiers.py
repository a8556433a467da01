"""The tiered engine (shared memory within a host, tcp between hosts), in-process: ranks
as threads, "hosts" given by the layout, so the host tier really runs on shared memory
and the cross-host tier in frames over the memory transport."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rankwise.api import collectives as C
from rankwise.api.world import World
from rankwise.core.group import ProcessGroup
from rankwise.engines import tiers
from rankwise.engines.base import Engine
from rankwise.engines.select import host_layout
from rankwise.errors import CollectiveMismatch
from rankwise.testing.engines import _deadline, _mismatch, _run, check_engine
from rankwise.wire.buffers import ReduceOp


def _maker(layout: list[list[int]]) -> Any:
    def make(group: ProcessGroup, store: Any, timeout: float) -> Engine:
        return tiers.TieredEngine.create(group, store, timeout, layout)

    return make


@pytest.fixture
def every_size_tiered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conformance table's calls are a few elements: tier them all the same."""
    monkeypatch.setattr(tiers, "TIERS_BYTES", 0)


def test_layout_needs_two_hosts_with_equal_members_two_or_more() -> None:
    assert host_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert host_layout(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]
    assert host_layout(["a", "b", "c", "a", "b", "c"]) == [[0, 3], [1, 4], [2, 5]]
    assert host_layout(["a", "a", "a"]) is None  # one host: the shm engine's
    assert host_layout(["a", "b"]) is None  # one rank per host: nothing to share
    assert host_layout(["a", "a", "b"]) is None  # uneven: the shares would not line up


def test_the_tiered_engine_passes_the_table(every_size_tiered: None) -> None:
    # The table's "peer that leaves" case is left out: a thread-rank that raises ends
    # without the goodbye a process sends, so rank 0, waiting between hosts for rank 2
    # (which raised when its host mate 3 left), would time out rather than hear why.
    make = _maker([[0, 1], [2, 3]])
    check_engine(make, size=4, failures=False)
    for is_async in (False, True):
        _mismatch(make, 4, 60.0, is_async)
        _deadline(make, 4, 1.0, 60.0, is_async)


def test_interleaved_hosts_and_a_ring_between_three(every_size_tiered: None) -> None:
    # group ranks that alternate between hosts, and three hosts (the ring, not halving)
    check_engine(_maker([[0, 2, 4], [1, 3, 5]]), size=6, dtypes=("float64", "int32"),
                 ops=("all_reduce",), failures=False)
    check_engine(_maker([[0, 3], [1, 4], [2, 5]]), size=6, dtypes=("float32",),
                 ops=("all_reduce",), failures=False)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "PRODUCT"])
def test_large_uneven_all_reduce_is_exact_and_bit_identical(
        op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # above the threshold, with a count the two host mates cannot split evenly (padding)
    monkeypatch.setattr(tiers, "TIERS_BYTES", 1 << 10)
    count, size = 1001, 4
    inputs = [np.random.default_rng(r).uniform(0.5, 1.5, count) for r in range(size)]
    want = {"SUM": np.sum, "AVG": np.mean, "MAX": np.max, "PRODUCT": np.prod}[op](
        np.stack(inputs), axis=0)

    def body(rank: int, world: World) -> Any:
        engine = world.default_group.engine
        assert engine.name == "tiers"
        x = inputs[rank].copy()
        C.all_reduce(x, op=getattr(ReduceOp, op))
        return x

    got = _run(_maker([[0, 1], [2, 3]]), size, 10.0, body, 20.0)
    for rank in range(size):
        assert not isinstance(got[rank], BaseException), got[rank]
        assert np.allclose(got[rank], want, rtol=1e-12)
        assert np.array_equal(got[rank], got[0])  # each element reduced in one place


@pytest.mark.parametrize("theirs", [2048, 16], ids=["both-tiered", "tiers-meet-doubling"])
def test_hosts_that_disagree_on_the_size_all_raise(
        theirs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # host mates agree with each other, hosts do not: only the frames between hosts can
    # tell, whether the second host's call is tiered too or below the threshold
    monkeypatch.setattr(tiers, "TIERS_BYTES", 1 << 12)

    def body(rank: int, world: World) -> Any:
        C.all_reduce(np.ones(4096 if rank < 2 else theirs))

    got = _run(_maker([[0, 1], [2, 3]]), 4, 5.0, body, 20.0)
    for rank in range(4):
        assert isinstance(got[rank], CollectiveMismatch), (rank, got[rank])


def _chosen(hosts: list[str], monkeypatch: pytest.MonkeyPatch, want: str) -> dict[int, Any]:
    """Each rank's engine name (or exception) when choose_engine sees these hosts."""
    from rankwise.engines.select import choose_engine

    monkeypatch.setenv("RANKWISE_ENGINE", want)

    def make(group: ProcessGroup, store: Any, timeout: float) -> Engine:
        group.backend = "gloo"  # the conformance job's own name is no backend
        return choose_engine(group, store, timeout, hosts=hosts)

    return {rank: getattr(got, "name", got) for rank, got in
            _run(make, len(hosts), 5.0, lambda rank, world: world.default_group.engine,
                 20.0).items()}


def test_auto_tiers_a_group_with_equal_ranks_on_each_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(_chosen(["a", "a", "b", "b"], monkeypatch, "auto").values()) == {"tiers"}
    assert set(_chosen(["a", "b", "b", "b"], monkeypatch, "auto").values()) == {"tcp"}
    assert set(_chosen(["a", "b", "a", "b"], monkeypatch, "tcp").values()) == {"tcp"}


def test_asking_for_tiers_where_they_cannot_run_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.engines.base import EngineUnavailable

    for hosts, why in ((["a", "a"], "on one host"), (["a", "b", "b"], "the same number")):
        for got in _chosen(hosts, monkeypatch, "tiers").values():
            assert isinstance(got, EngineUnavailable) and why in str(got), got
