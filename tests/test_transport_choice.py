"""``RANKWISE_TRANSPORT``: which transport reaches which peer, on real processes.

Hosts are simulated by giving ranks different host identities (the only input the
factory uses to tell hosts apart), so a mixed-host job runs on one machine.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from rankwise.testing import free_port, run_ranks

TIMEOUT = 90


def w_job(rank: int, size: int, port: int, hosts: str) -> Any:
    """Init with host identity ``hosts[rank]``, then p2p with every peer, an all_reduce
    and an object all_gather; returns {peer: transport class name} as routed."""
    import rankwise as dist
    from rankwise.api.world import current
    from rankwise.transport import factory

    host = hosts[rank]
    factory.host_identity = lambda: f"host-{host}"  # type: ignore[assignment]
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=60)
    for peer in range(size):  # every pair, both directions, 3 MiB each (> one ring piece)
        if peer == rank:
            continue
        mine = np.full(3 << 18, rank * 100 + peer, np.float32)
        got = np.empty_like(mine)
        if rank < peer:
            dist.send(mine, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(mine, peer)
        assert (got == peer * 100 + rank).all(), f"rank {rank} got wrong data from {peer}"
    x = np.full(1000, rank + 1, np.int64)
    dist.all_reduce(x)
    assert (x == size * (size + 1) // 2).all()
    objs: list[Any] = [None] * size
    dist.all_gather_object(objs, ("rank", rank))
    assert objs == [("rank", r) for r in range(size)]
    t = current().comm.transport
    route = getattr(t, "_route", None)
    kinds = {p: type(route[p] if route else t).__name__ for p in range(size) if p != rank}
    dist.destroy_process_group()
    return kinds


def w_job_without_shm(rank: int, size: int, port: int, hosts: str) -> Any:
    """``w_job`` where shared memory cannot be used: every segment fails to open."""
    from rankwise.shmem.errors import ShmUnavailable
    from rankwise.transport import shm

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ShmUnavailable("shared memory refused by the test")

    shm.open_segment = refuse  # type: ignore[assignment]
    return w_job(rank, size, port, hosts)


def _run(hosts: str, transport: str, job: Any = w_job, **env: str) -> list[Any]:
    return run_ranks(job, len(hosts), args=(free_port(), hosts), init=False,
                     timeout=TIMEOUT, env={"RANKWISE_TRANSPORT": transport,
                                           "RANKWISE_ENGINE": "tcp", **env})


@pytest.mark.procs
def test_auto_uses_shm_within_a_host_and_tcp_between_hosts() -> None:
    results = _run("AABB", "auto")
    assert all(r.ok for r in results), [r.traceback or r.message for r in results]
    for r in results:
        for peer, kind in r.value.items():
            same_host = "AABB"[peer] == "AABB"[r.rank]
            assert kind == ("ShmTransport" if same_host else "TcpTransport"), (r.rank, peer)


@pytest.mark.procs
def test_shm_across_hosts_is_an_error_on_every_rank() -> None:
    results = _run("AB", "shm")
    for r in results:
        assert r.raised("DistNetworkError"), r.traceback or r.message
        assert "do not share one host" in r.message


@pytest.mark.procs
def test_auto_falls_back_to_tcp_when_shared_memory_is_unusable() -> None:
    results = _run("AAA", "auto", job=w_job_without_shm)
    assert all(r.ok for r in results), [r.traceback or r.message for r in results]
    assert all(set(r.value.values()) == {"TcpTransport"} for r in results)


def test_a_bad_transport_name_fails_before_any_connection(monkeypatch: Any) -> None:
    import rankwise as dist
    from rankwise.errors import InvalidArgument

    monkeypatch.setenv("RANKWISE_TRANSPORT", "carrier-pigeon")
    with pytest.raises(InvalidArgument, match="RANKWISE_TRANSPORT"):
        # nothing listens on this port: reaching it would be a different error
        dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=1, world_size=2, timeout=5)


def w_blob(rank: int, size: int, port: int) -> Any:
    """Init over tcp; what the rendezvous left in the store for the transport."""
    import rankwise as dist
    from rankwise.api.world import current

    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=60)
    store = current().rendezvous
    verdict = store.get("joined/all").decode().split("\n")
    gathered_again = store.check(["mesh/addrs"])  # rank 0's own gather, without the blob
    x = np.full(4, rank + 1, np.int64)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return verdict, gathered_again, int(x[0])


@pytest.mark.procs
@pytest.mark.parametrize("connect", ["eager", "lazy"])
def test_tcp_ranks_learn_every_address_in_the_rendezvous(connect: str) -> None:
    """Each rank publishes its data address (and host identity) before counting itself
    in; the last to join hands all of them out with the verdict, so no rank gathers them
    again."""
    out = run_ranks(w_blob, 3, args=(free_port(),), init=False, timeout=TIMEOUT,
                    env={"RANKWISE_TRANSPORT": "tcp", "RANKWISE_ENGINE": "tcp",
                         "RANKWISE_CONNECT": connect})
    assert all(r.ok for r in out), [r.traceback or r.message for r in out]
    for verdict, gathered_again, total in (r.value for r in out):
        assert verdict[0] == "ok" and len(verdict) == 5, verdict
        assert len(json.loads(verdict[1])["hosts"]) == 3, verdict  # every rank's host
        assert all(":" in line for line in verdict[2:]), verdict
        assert not gathered_again
        assert total == 6


def test_the_blob_is_gathered_only_when_every_rank_published_its_address() -> None:
    from rankwise.store import HashStore
    from rankwise.transport.mesh import gather_addresses

    store = HashStore()
    store.set("mesh/addr/0", "10.0.0.1:5 2")
    store.set("mesh/addr/2", "10.0.0.3:7 2")
    assert gather_addresses(store, 3) is None  # rank 1 asked for another transport
    store.set("mesh/addr/1", "10.0.0.2:6 2")
    assert gather_addresses(store, 3) == "10.0.0.1:5 2\n10.0.0.2:6 2\n10.0.0.3:7 2"
