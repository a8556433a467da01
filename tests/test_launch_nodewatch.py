"""The launchers' node watch (``launch/nodewatch.py``) in-process: when it judges, and what a
watch that does not judge (one node, heartbeats off) must never claim."""

from __future__ import annotations

import time

import pytest

from rankwise.launch.agent import AttemptResult
from rankwise.launch.elastic import Round
from rankwise.launch.job import JobOptions, _may_restart
from rankwise.launch.nodewatch import NodeWatch
from rankwise.launch.rendezvous import StorePeers
from rankwise.launch.summary import WorkerOutcome
from rankwise.store import HashStore


def _killed_rank() -> AttemptResult:
    return AttemptResult(outcomes=[WorkerOutcome(rank=0, local_rank=0, node_rank=0, pid=1,
                                                 returncode=-9, observed_at=0.0)])


@pytest.mark.parametrize(("hosts", "node", "timeout"), [(["h0"], 0, 15.0),
                                                        (["h0", "h1"], 1, 0.0)])
def test_a_watch_that_does_not_judge_never_calls_the_store_or_a_node_lost(
        hosts: list[str], node: int, timeout: float) -> None:
    """One node in the round, or RANKWISE_HEARTBEAT_TIMEOUT=0: no beat thread runs, so
    silence measures nothing. Before, 3.5 s after the start the store counted as lost (a
    single node refused to restart) and the other node as silent (a false "lost")."""
    store = HashStore()
    watch = NodeWatch(lambda: store, node, hosts, 2, timeout=timeout)
    watch.start(lambda text: None)
    watch.store_ok_at -= 60  # a minute of "silence" later
    watch._heard = {n: t - 60 for n, t in watch._heard.items()}
    assert watch.store_answers()
    assert watch.suspect() == "" and watch.await_suspect() == ""
    rnd = Round(0, node, len(hosts), StorePeers(store, lambda: store, node), watch)
    opts = JobOptions(cmd=["x"], min_nodes=1, max_nodes=2, max_restarts=1)
    assert _may_restart(_killed_rank(), opts, rnd)


def test_a_node_that_finished_is_not_lost_when_its_store_goes() -> None:
    """Node 0 hosts the store and finished (``finish``): node 1 must not then report it as
    "stopped answering" once the store closes."""
    store = HashStore()
    watch = NodeWatch(lambda: store, 1, ["h0", "h1"], 2, timeout=0.4)
    watch.start(lambda text: None)
    try:
        StorePeers(store, lambda: store, 0).finish(2, hosting=False, timeout=1.0)
        deadline = time.monotonic() + 10
        while 0 not in watch._ended and time.monotonic() < deadline:
            time.sleep(0.02)  # bounded polling of the beat thread's record
        assert 0 in watch._ended
    finally:
        watch.stop()
    assert watch.verdict(watch.store_ok_at + 60) == ""
