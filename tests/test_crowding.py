"""The crowded-job verdict (``transport.crowding``) and the all_reduce it picks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _procs
import pytest
from launch_scripts.helpers import SCRIPTS, env, launcher_cmd

from rankwise import algorithms as alg
from rankwise.core import messages
from rankwise.core.messages import (
    CROWDED_TREE_FROM,
    RING_THRESHOLD,
    all_reduce_algorithm,
    barrier_algorithm,
)
from rankwise.transport import crowding


def test_entries_round_trip_and_lines_without_cpus_read_as_unknown() -> None:
    addr, cpus = crowding.parse(crowding.entry("10.0.0.7", 4242))
    assert addr == "10.0.0.7:4242" and cpus >= 1
    assert crowding.parse("10.0.0.7:4242") == ("10.0.0.7:4242", 0)


@pytest.mark.parametrize(("lines", "verdict"), [
    (["127.0.0.1:1 2", "127.0.0.1:2 2"], False),                    # a CPU each
    (["127.0.0.1:1 2", "127.0.0.1:2 2", "127.0.0.1:3 2"], True),     # 3 ranks, 2 CPUs
    (["10.0.0.1:1 1", "10.0.0.2:1 1"], False),                        # two hosts, 1 each
    (["10.0.0.1:1 1", "10.0.0.1:2 1", "10.0.0.2:1 8"], True),         # one host crowded
    (["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], False),          # unknown: never a crowd
])
def test_crowded_when_one_address_has_more_ranks_than_cpus(lines: list[str],
                                                          verdict: bool) -> None:
    assert crowding.crowded(lines) is verdict


def test_small_all_reduce_goes_up_a_tree_only_in_a_crowded_group_of_enough_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "ALLREDUCE_ALGORITHM", "auto")
    n = CROWDED_TREE_FROM
    assert all_reduce_algorithm(4, 1, n, crowded=True) is alg.tree.all_reduce
    assert all_reduce_algorithm(4, 1, n, crowded=False) is alg.doubling.all_reduce
    assert all_reduce_algorithm(4, 1, n - 1, crowded=True) is alg.doubling.all_reduce
    assert all_reduce_algorithm(RING_THRESHOLD, RING_THRESHOLD, n, crowded=True) \
        is not alg.tree.all_reduce
    monkeypatch.setattr(messages, "ALLREDUCE_ALGORITHM", "tree")
    assert all_reduce_algorithm(4, 1, 2) is alg.tree.all_reduce


def test_barrier_goes_up_the_tree_where_small_all_reduces_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "ALLREDUCE_ALGORITHM", "auto")
    n = CROWDED_TREE_FROM
    assert barrier_algorithm(n, crowded=True) is alg.tree.barrier
    assert barrier_algorithm(n, crowded=False) is alg.doubling.barrier
    assert barrier_algorithm(n - 1, crowded=True) is alg.doubling.barrier
    monkeypatch.setattr(messages, "ALLREDUCE_ALGORITHM", "tree")
    assert barrier_algorithm(2) is alg.tree.barrier


@pytest.mark.procs
def test_a_crowded_job_sums_and_holds_every_barrier(tmp_path: Path) -> None:
    """8 tcp ranks pinned to one CPU: the tree barrier and all_reduce, read by the calls
    themselves (no I/O-thread hand-off), give every rank the sum, and no rank leaves a
    barrier before all have arrived."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed: cannot pin the job to one CPU")
    e = env()
    e.update(RANKWISE_ENGINE="tcp", RANKWISE_CONNECT="lazy")
    res = _procs.run(["taskset", "-c", "0", *launcher_cmd(
        "-n", "8", str(SCRIPTS / "crowded_worker.py"), str(tmp_path))], env=e, timeout=120)
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    out = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(8)]
    for rec in out:
        assert rec["crowded"] is True and rec["world"] == 8
        assert rec["sums"] == [28.0, 36.0, 44.0]
        assert rec["complete"] == [8, 8, 8]
