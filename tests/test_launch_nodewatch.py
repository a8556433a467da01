"""The launchers' node watch (``launch/nodewatch.py``) and waits for nodes, in-process: when
it judges, what a watch that does not judge (one node, heartbeats off) must never claim, and
what a launcher waiting for nodes says."""

from __future__ import annotations

import time

import pytest

from rankwise.cli import parse_run_args
from rankwise.errors import RendezvousError
from rankwise.launch import rendezvous as rendezvous_mod
from rankwise.launch.agent import AttemptResult
from rankwise.launch.elastic import Round
from rankwise.launch.job import JobOptions, _may_restart, _too_few_left
from rankwise.launch.nodewatch import NodeWatch
from rankwise.launch.rendezvous import NodeInfo, StorePeers
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


def test_a_waiting_launcher_says_who_is_missing_and_until_when(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At once (after a quiet second), then every PROGRESS_EVERY seconds; bounded by
    --rdzv-timeout. Before, the wait was silent for its 300 s."""
    monkeypatch.setattr(rendezvous_mod, "PROGRESS_EVERY", 0.4)
    said: list[str] = []
    me = NodeInfo(host="h0", pid=7, nproc=2, node_rank=0, min_nodes=2, max_nodes=2,
                  rdzv_id="r")
    with pytest.raises(RendezvousError, match="raise --rdzv-timeout"):
        rendezvous_mod.rendezvous(HashStore(), me, timeout=2.0, say=said.append)
    assert len(said) >= 2, said
    assert said[0].startswith("rankwise run: waiting for 1 more node (1 of 2 needed joined, "
                              "waited 1 s; here: h0 (launcher pid 7, node rank 0); missing: "
                              "node rank 1); giving up at "), said
    assert said[0].endswith("(--rdzv-timeout 2 s)"), said
    assert parse_run_args(["--rdzv-timeout", "7", "x.py"]).timeout == 7.0
    assert parse_run_args(["--rdzv_timeout", "8", "x.py"]).timeout == 8.0


def test_no_restart_that_could_only_wait_for_a_node_known_lost() -> None:
    """--nnodes 2:2 --max-restarts 1 and the watch knows node 1 is gone: say so and stop,
    instead of a restart that waits out the rendezvous timeout for it."""
    store = HashStore()
    watch = NodeWatch(lambda: store, 0, ["h0", "h1"], 2, timeout=5.0)
    watch.lost = "node 1 (h1, ranks 2-3) stopped answering 5.1 s ago"
    rnd = Round(0, 0, 2, StorePeers(store, lambda: store, 0), watch)
    fixed = JobOptions(cmd=["x"], min_nodes=2, max_nodes=2, max_restarts=1, timeout=300)
    text = _too_few_left(_killed_rank(), fixed, rnd, 0)
    assert text.startswith("rankwise run: not restarting: node 1 (h1, ranks 2-3) stopped "
                           "answering"), text
    assert "--nnodes 2 needs 2" in text and "--rdzv-timeout (300 s)" in text, text
    elastic = JobOptions(cmd=["x"], min_nodes=1, max_nodes=2, max_restarts=1)
    assert _too_few_left(_killed_rank(), elastic, rnd, 0) == ""  # 1 node may go on


def test_one_store_beat_reads_every_node_right() -> None:
    """The store beat is one batch (a slow link pays per round trip): each node's counter
    and its two "done" records land where they belong, whichever of them are set."""
    store = HashStore()
    watch = NodeWatch(lambda: store, 0, ["h0", "h1", "h2"], 1, timeout=0.4)
    store.add("rankwise/nodebeat/2", 5)
    watch._store_beat(store)
    assert watch._ended == set() and watch._counts == {1: 0, 2: 5}
    store.set("rankwise/nodebeat/1/end", "1")  # node 1's beats ended
    store.set("rankwise/rdzv/end/2", "1")  # node 2's launcher finished
    watch._store_beat(store)
    assert watch._ended == {1, 2} and int(store.get("rankwise/nodebeat/0")) == 2
