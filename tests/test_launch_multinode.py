"""Several launchers on loopback form one job through node 0's store; mismatches are refused."""

from __future__ import annotations

import json
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from launch_scripts.helpers import JOB, free_port, read_lines_until, run_launcher, start_launcher

from rankwise.errors import RendezvousError
from rankwise.launch.elastic import await_round, close_rounds
from rankwise.launch.rendezvous import NodeInfo, assign_ranks, rendezvous
from rankwise.store import HashStore, TCPStore


def _node(nproc: int = 2, rank: int = -1, rdzv: str = "j", pid: int = 1) -> NodeInfo:
    return NodeInfo(host="h", pid=pid, nproc=nproc, node_rank=rank, min_nodes=2, max_nodes=2,
                    rdzv_id=rdzv)


def test_assign_ranks_keeps_explicit_and_fills_in_arrival_order() -> None:
    infos = [_node(pid=1), _node(rank=0, pid=2), _node(pid=3)]
    assert assign_ranks(infos) == [1, 0, 2]
    with pytest.raises(RendezvousError, match="only 3 nodes"):
        assign_ranks([_node(rank=5), _node(), _node()])


def test_rendezvous_in_threads() -> None:
    store = HashStore()
    results: dict[int, int] = {}

    def join(pid: int, rank: int) -> None:
        results[pid] = rendezvous(store, _node(rank=rank, pid=pid), timeout=10).node_rank

    threads = [threading.Thread(target=join, args=(p, r)) for p, r in ((1, -1), (2, 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == {1: 1, 2: 0}
    with pytest.raises(RendezvousError, match="already closed its rendezvous with 2 nodes"):
        rendezvous(store, _node(pid=3), timeout=1)


@pytest.mark.parametrize(("bad", "words"), [
    (_node(nproc=3, pid=9), "nproc-per-node: 3 here vs 2 there"),
    (_node(rdzv="other", pid=9), "rdzv id: 'other' here vs 'j' there"),
])
def test_mismatch_names_both_nodes(bad: NodeInfo, words: str) -> None:
    store = HashStore()
    store.compare_set("rankwise/rdzv/job", "", _node(pid=1).dumps())
    with pytest.raises(RendezvousError) as info:
        rendezvous(store, bad, timeout=1)
    assert words in str(info.value)
    assert "launcher pid 1" in str(info.value) and "launcher pid 9" in str(info.value)


def test_duplicate_node_rank_names_both() -> None:
    store = HashStore()
    store.compare_set("rankwise/rdzv/rank/1", "", _node(rank=1, pid=1).dumps())
    with pytest.raises(RendezvousError, match="duplicate node rank 1.*pid 1.*pid 9"):
        rendezvous(store, _node(rank=1, pid=9), timeout=1)


@pytest.mark.slow
@pytest.mark.procs
def test_two_launchers_form_one_2x2_job_and_refuse_a_third(tmp_path: Path) -> None:
    port = free_port()
    common = ("--nnodes", "2", "--master-port", str(port), "--rdzv-id", "t1", "--grace", "0.5",
              "--timeout", "20", "--no-prefix")
    job = (JOB, "--out", str(tmp_path), "--wait", "30")
    first = start_launcher("-n", "2", *common, *job)
    second = start_launcher("-n", "2", "--node-rank", "1", *common, *job)
    try:
        for proc in (first, second):
            read_lines_until(proc, lambda line: line.startswith("READY"), 2, timeout=30)
        bad = run_launcher("-n", "3", *common, *job, timeout=20)
        assert bad.returncode == 1
        assert "refusing to join" in bad.stderr
        assert "nproc-per-node: 3 here vs 2 there" in bad.stderr
        assert bad.stderr.count("launcher pid") == 2, bad.stderr
        dup = run_launcher("-n", "2", "--node-rank", "1", *common, *job, timeout=20)
        assert dup.returncode == 1
        assert "duplicate node rank 1" in dup.stderr and f"pid {second.pid}" in dup.stderr
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10)).set("release", "1")
        for proc in (first, second):
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    envs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("env_*_0.json"))]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    for e in envs:
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * 2 + int(e["LOCAL_RANK"])
        assert e["MASTER_PORT"] == str(port) and e["GROUP_WORLD_SIZE"] == "2"


@pytest.mark.slow
@pytest.mark.procs
def test_failure_on_one_node_stops_the_other(tmp_path: Path) -> None:
    port = free_port()
    common = ("-n", "2", "--nnodes", "2", "--master-port", str(port), "--grace", "0.5",
              "--timeout", "20", "--no-prefix", JOB, "--out", str(tmp_path), "--wait", "60",
              "--fail-rank", "3", "--mode", "exit3")
    procs = [start_launcher(*common) for _ in range(2)]
    try:
        results = [p.communicate(timeout=40) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("launchers did not end")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [3, 3], results
    errs = [err for _, err in results]
    assert any("rank       : 3 " in e for e in errs)
    assert any("Root cause (on another node): rank 3 (node 1) exit code 3" in e for e in errs), errs
    for rank in (0, 1, 2):
        assert (tmp_path / f"finally_{rank}_0").exists()


def _waiting(store: HashStore, timeout: float) -> object:
    """``await_round`` for a 1:2 job with 2 restarts over one shared in-memory store."""
    def client(t: float | None) -> HashStore:
        store.set_timeout(timeout if t is None else t)
        return store

    return await_round(client, 2, 1, 2, "j", max_restarts=2, timeout=timeout)


def test_waiting_node_is_released_when_the_job_ends_or_times_out() -> None:
    store = HashStore()
    close_rounds(store, current=0, max_restarts=2)  # the job ended in its first round
    assert _waiting(store, 5.0) is None
    with pytest.raises(RendezvousError, match="none opened; raise --timeout"):
        _waiting(HashStore(), 0.2)  # no round ever opens: bounded by the timeout


def test_waiting_node_skips_a_full_round() -> None:
    """Round 1 filled up without the late node: it goes on to round 2, and is released
    there when the job ends."""
    store = HashStore()
    store.set("rankwise/rdzv/wake/1", "open")
    first = NodeInfo(host="h", pid=1, nproc=2, node_rank=0, min_nodes=1, max_nodes=2,
                     rdzv_id="j")
    store.set("rankwise/round1/rankwise/rdzv/job", first.dumps())
    store.set("rankwise/round1/rankwise/rdzv/closed", "2")
    close_rounds(store, current=1, max_restarts=2)
    assert _waiting(store, 5.0) is None
