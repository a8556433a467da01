"""Init failures (issue 2, items 2 and 3): rendezvous, store and authentication.

Every case ends in a named exception on every process that took part, within a bound
well below what a hang would cost: missing ranks are named at the (short) timeout;
duplicate ranks, disagreeing world sizes, a port in use and a wrong token are
reported as soon as they are detected.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from _error_cases import assert_every_rank

import rankwise as dist
from rankwise.testing import free_port, run_ranks


def _init(rank: int, world: int, port: int, timeout: float, **kw: Any) -> None:
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout, **kw)


def _join(rank: int, world: int, port: int, ranks: list[int], worlds: list[int],
          timeout: float, tokens: list[str | None] | None = None) -> float:
    """Process ``rank`` of the launch claims ``ranks[rank]`` in a world of ``worlds[rank]``."""
    token = tokens[rank] if tokens else None
    _init(ranks[rank], worlds[rank], port, timeout, token=token)
    a = np.ones(2, np.float32)
    dist.all_reduce(a)
    return float(a[0])


@pytest.mark.procs
def test_missing_rank_is_named_on_every_rank_at_the_timeout() -> None:
    # world_size 3, only ranks 0 and 1 start
    results = run_ranks(_join, 2, args=(free_port(), [0, 1], [3, 3], 3.0), init=False,
                        timeout=40)
    assert_every_rank(results, "RendezvousError", "missing ranks [2]", "2 of 3", within=8.0)
    for r in results:
        assert r.elapsed > 2.5, f"rank {r.rank} gave up before its timeout: {r.elapsed:.1f}s"


@pytest.mark.procs
def test_duplicate_rank_fails_every_process_at_once() -> None:
    # three processes; two of them claim rank 1. Timeout 20 s, failure expected in ~1 s.
    results = run_ranks(_join, 3, args=(free_port(), [0, 1, 1], [3, 3, 3], 20.0),
                        init=False, timeout=40)
    assert_every_rank(results, "RendezvousError", "two processes claim rank 1", within=8.0)


@pytest.mark.procs
def test_world_size_disagreement_fails_every_process_at_once() -> None:
    results = run_ranks(_join, 3, args=(free_port(), [0, 1, 2], [3, 3, 4], 20.0),
                        init=False, timeout=40)
    assert_every_rank(results, "RendezvousError", "world sizes disagree", within=8.0)


def _join_as_version(rank: int, world: int, port: int, versions: list[str],
                     timeout: float) -> float:
    """``_join`` as a process whose rankwise says it is ``versions[rank]``."""
    from rankwise.api import rendezvous

    rendezvous.__version__ = versions[rank]
    return _join(rank, world, port, list(range(world)), [world] * world, timeout)


@pytest.mark.procs
def test_different_rankwise_versions_fail_every_process_at_once() -> None:
    """Two installs in one job (one node updated, the other not) are named in the
    rendezvous, before any frame of one version meets the other's decoder."""
    results = run_ranks(_join_as_version, 3, args=(free_port(), ["0.1.0", "0.1.0", "0.2.0"],
                                                   20.0), init=False, timeout=40)
    assert_every_rank(results, "RendezvousError", "runs rankwise 0.", "the same rankwise",
                      within=8.0)


def _join_after_the_error(rank: int, world: int, port: int, ranks: list[int],
                          worlds: list[int], timeout: float) -> float:
    """Like ``_join``, but the last process starts only once the others found the error
    (a process slow to start): it must still get the explanation, not a dead store."""
    if rank == world - 1:
        watcher = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        watcher.wait(["rankwise/0/error"])
        del watcher
    return _join(rank, world, port, ranks, worlds, timeout)


@pytest.mark.procs
def test_a_late_process_still_learns_why_the_rendezvous_failed() -> None:
    # ranks 0 and 2 disagree on the world size at once; rank 1 comes in afterwards
    results = run_ranks(_join_after_the_error, 3, args=(free_port(), [0, 2, 1], [3, 4, 3],
                                                        20.0), init=False, timeout=40)
    assert_every_rank(results, "RendezvousError", "world sizes disagree", within=12.0)


def test_port_in_use_is_a_network_error_saying_so() -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistNetworkError) as info:
            _init(0, 2, port, 5.0)
        assert time.monotonic() - start < 3.0
        msg = str(info.value)
        assert "in use" in msg and str(port) in msg, msg
        assert not dist.is_initialized()
    finally:
        squatter.close()


def test_unreachable_master_names_host_and_port() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(dist.DistError) as info:
        _init(1, 2, port, 2.0)
    elapsed = time.monotonic() - start
    assert elapsed < 6.0, f"took {elapsed:.1f}s with a 2s timeout"
    assert f"127.0.0.1:{port}" in str(info.value), str(info.value)
    assert isinstance(info.value, (dist.DistNetworkError, dist.DistTimeout)), repr(info.value)
    assert not dist.is_initialized()


def test_master_port_held_by_a_silent_stranger_is_bounded() -> None:
    # rank 1 reaches something that accepts connections but never speaks the store protocol
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(4)
    port = squatter.getsockname()[1]
    conns: list[socket.socket] = []

    def accept() -> None:
        squatter.settimeout(8)
        try:
            while True:
                conns.append(squatter.accept()[0])
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistError) as info:
            _init(1, 2, port, 2.0)
        elapsed = time.monotonic() - start
        assert elapsed < 8.0, f"took {elapsed:.1f}s with a 2s timeout"
        assert str(port) in str(info.value), str(info.value)
        assert not dist.is_initialized()
    finally:
        squatter.close()
        for c in conns:
            c.close()


@pytest.mark.procs
def test_wrong_token_on_one_rank_fails_fast_and_the_others_bounded() -> None:
    timeout = 4.0
    results = run_ranks(_join, 3, args=(free_port(), [0, 1, 2], [3, 3, 3], timeout,
                                        ["s3cret", "s3cret", "guess"]),
                        init=False, timeout=40)
    bad = results[2]
    assert bad.raised("AuthError"), f"{bad.error_type}: {bad.message}"
    assert "token" in bad.message.lower(), bad.message
    assert bad.elapsed < 3.0, f"wrong token noticed after {bad.elapsed:.1f}s"
    # the ranks with the right token cannot form the group: they name the missing rank,
    # and why it is probably missing (the store saw a connection fail the token check)
    assert_every_rank(results, "RendezvousError", "missing ranks [2]", within=timeout + 4,
                      ranks=[0, 1])
    for r in results[:2]:
        assert "failed the token check" in r.message, r.message


@pytest.mark.procs
def test_missing_token_on_one_rank_is_an_auth_error() -> None:
    results = run_ranks(_join, 2, args=(free_port(), [0, 1], [2, 2], 4.0, ["s3cret", None]),
                        init=False, timeout=40, env={"RANKWISE_TOKEN": ""})
    assert results[1].raised("AuthError"), f"{results[1].error_type}: {results[1].message}"
    assert results[1].elapsed < 3.0
    assert_every_rank(results, "DistError", within=9.0)


@pytest.mark.procs
def test_same_token_everywhere_works() -> None:
    results = run_ranks(_join, 3, args=(free_port(), [0, 1, 2], [3, 3, 3], 10.0,
                                        ["s3cret"] * 3), init=False, timeout=40)
    for r in results:
        assert r.ok and r.value == 3.0, f"rank {r.rank}: {r.error_type}: {r.message}"
    # and through the environment variable
    results = run_ranks(_join, 2, args=(free_port(), [0, 1], [2, 2], 10.0), init=False,
                        timeout=40, env={"RANKWISE_TOKEN": "from-env"})
    for r in results:
        assert r.ok and r.value == 2.0, f"rank {r.rank}: {r.error_type}: {r.message}"
