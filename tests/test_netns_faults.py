"""Faults between simulated hosts (network namespaces): partitions, lost nodes, frozen ranks.

2 hosts x 2 ranks under ``rankwise run``. Heartbeat timeout 3 s (``RANKWISE_HEARTBEAT_TIMEOUT``)
where the default (15 s) is not what is tested, so the file stays short; the heal test uses
10 s so that a 2 s cut stays well inside it. Every test's namespaces and processes go away in
the fixture's finalizer, also when the test fails.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _netns import SimHosts, two_hosts, unavailable
from _netns_job import Job

_WHY = unavailable()
pytestmark = [pytest.mark.procs, pytest.mark.skipif(bool(_WHY), reason=f"no simulated hosts: {_WHY}")]

FAST = {"RANKWISE_HEARTBEAT_TIMEOUT": "3"}


hosts = pytest.fixture(two_hosts, name="hosts")


def _ready(job: Job) -> dict[int, int]:
    """Wait for all 4 ranks to work; their pids by rank."""
    assert job.wait_for(lambda ls: sum(line.startswith("ready ") for line in ls) == 4, 90), job.text()
    return {int(line.split()[1]): int(line.split()[2])
            for _, _, line in job.lines if line.startswith("ready ")}


def _raised(job: Job) -> list[str]:
    return [line for _, _, line in job.lines if line.startswith("raised ")]


def test_partition_for_good_fails_both_sides_and_ends_both_launchers(hosts: SimHosts) -> None:
    job = Job(hosts, ["loop", "120"], FAST)
    _ready(job)
    hosts.cut(1)
    assert job.wait_for(lambda ls: sum(line.startswith("raised ") for line in ls) == 4, 45), job.text()
    for line in _raised(job):  # the ranks' own heartbeats, or their launcher's news
        assert "PeerFailure" in line and "stopped answering" in line, line
        assert "network partition, host down or " in line, line
    codes = [job.wait_exit(n, 60) for n in range(2)]
    assert codes == [1, 1], job.text()
    assert "Root cause (the launcher ended the job): node 1 (h1, ranks 2-3) stopped answering" \
        in job.text(0), job.text(0)
    assert "node 0 (h0, ranks 0-1) stopped answering" in job.text(1), job.text(1)
    assert hosts.pids(0) == [] and hosts.pids(1) == []


def test_partition_that_heals_loses_nothing(hosts: SimHosts) -> None:
    # with large calls too: those run on shared memory within each host, tcp between them
    job = Job(hosts, ["large", "5"], {"RANKWISE_HEARTBEAT_TIMEOUT": "10"})
    _ready(job)
    engines = {line.split()[4] for _, _, line in job.lines if line.startswith("ready ")}
    assert engines == {"tiers"}, job.text()
    hosts.cut(1)
    time.sleep(2.0)  # the fault's duration, not a synchronization
    hosts.heal(1)
    healed = time.monotonic()
    assert [job.wait_exit(n, 60) for n in range(2)] == [0, 0], job.text()
    assert job.wait_for(lambda ls: sum(line.startswith("done ") for line in ls) == 4, 10)
    # the ranks were still calling when the cut healed: it fell inside the job's loop (no
    # all_reduce across the cut can end before the heal)
    done = [t for t, _, line in job.first_time("done ") if line.startswith("done ")]
    assert all(t > healed for t in done), job.text()
    assert _raised(job) == []  # every all_reduce result was checked on every rank


def test_node_sigkill_ends_the_other_node(hosts: SimHosts) -> None:
    job = Job(hosts, ["large", "120"], FAST)
    _ready(job)
    for pid in hosts.pids(1):
        os.kill(pid, signal.SIGKILL)
    assert job.wait_exit(0, 20) == 1, job.text()
    assert job.wait_for(lambda ls: sum(line.startswith("raised ") for line in ls) == 2, 5)
    assert all("rank 2" in line or "rank 3" in line for line in _raised(job)), job.text()


def test_launcher_sigkill_ends_the_other_launcher(hosts: SimHosts) -> None:
    job = Job(hosts, ["loop", "120"], FAST)
    _ready(job)
    start = time.monotonic()
    job.launchers[1].send_signal(signal.SIGKILL)  # the `ip netns exec` chain execs into it
    assert job.wait_exit(0, 20) == 1, job.text()
    assert time.monotonic() - start < 20
    # the summary leads with the vanished node (its ranks die with their launcher), not
    # with a rank that died of it
    assert "Root cause (the launcher ended the job): node 1 (h1, ranks 2-3) died" \
        in job.text(0), job.text(0)
    assert job.wait_exit(1, 10) is not None
    for _ in range(100):  # the killed launcher's ranks die of PR_SET_PDEATHSIG
        if not hosts.pids(1):
            break
        time.sleep(0.1)
    assert hosts.pids(1) == []


def test_frozen_rank_is_reported(hosts: SimHosts) -> None:
    job = Job(hosts, ["loop", "120"], FAST)
    pids = _ready(job)
    os.kill(pids[3], signal.SIGSTOP)
    try:
        assert job.wait_for(lambda ls: any(line.startswith("raised 0") for line in ls), 30), job.text()
    finally:
        os.kill(pids[3], signal.SIGCONT)
    line = next(x for x in _raised(job) if x.startswith("raised 0"))
    assert "rank 3 on host h1 stopped answering" in line and "frozen process" in line, line
    assert [job.wait_exit(n, 60) for n in range(2)] == [1, 1], job.text()
    # node 0 finished; it did not stop answering. Node 0 names the frozen rank, not a victim
    assert "node 0 (h0, ranks 0-1) stopped answering" not in job.text(1), job.text(1)
    assert "Root cause (on another node): rank 3, as rank " in job.text(0), job.text(0)
    assert "rank       : 3 " in job.text(1), job.text(1)


def test_rank_busy_in_python_is_never_reported(hosts: SimHosts) -> None:
    # 8 s busy: past twice the heartbeat timeout (3 s; a rank that stopped beating is
    # reported within ~3.7 s, test_frozen_rank_is_reported) and past the sockets'
    # keepalive idle time (2 x 3 s), so neither may take the busy rank for a lost one
    job = Job(hosts, ["busy", "8"], FAST)
    _ready(job)
    assert [job.wait_exit(n, 90) for n in range(2)] == [0, 0], job.text()
    assert _raised(job) == []
    assert sum(line.startswith("done ") for _, _, line in job.lines) == 4


def test_elastic_restart_goes_on_without_a_lost_node(hosts: SimHosts) -> None:
    """``--nnodes 1:2 --max-restarts 1``: node 1 is killed; node 0 meets alone in a new
    rendezvous round and completes the job with 2 ranks."""
    job = Job(hosts, ["loop", "3"], FAST, nnodes="1:2", extra=["--max-restarts", "1"])
    _ready(job)
    for pid in hosts.pids(1):
        os.kill(pid, signal.SIGKILL)
    assert job.wait_exit(0, 60) == 0, job.text()
    text = job.text(0)
    assert "rendezvous round 1: 1 node(s), this is node 0; 2 ranks" in text, text
    assert sum(line.startswith("done ") for _, n, line in job.lines if n == 0) == 2, text


def test_fixed_size_job_does_not_wait_for_a_node_lost_for_good(hosts: SimHosts) -> None:
    """``--nnodes 2 --max-restarts 1``, host 1 killed: node 0's watch knows node 1 is gone
    and 2 nodes cannot meet again, so it ends saying so (before: a restart that waited out
    the 300 s rendezvous timeout in silence)."""
    job = Job(hosts, ["loop", "120"], FAST, extra=["--max-restarts", "1"])
    _ready(job)
    for pid in hosts.pids(1):
        os.kill(pid, signal.SIGKILL)
    assert job.wait_exit(0, 30) == 1, job.text()
    assert "rankwise run: not restarting: node 1 (h1, ranks 2-3) died: its ranks' " \
        "connections closed" in job.text(0), job.text(0)
    # the whole node died, not "rank 2": the summary says so
    assert "Root cause (the launcher ended the job): node 1 (h1, ranks 2-3) died" \
        in job.text(0), job.text(0)
    assert "restarting the group" not in job.text(0), job.text(0)


def test_heartbeats_off_blame_no_node(hosts: SimHosts) -> None:
    """RANKWISE_HEARTBEAT_TIMEOUT=0 turns the node watch off: a rank killed on node 1 is the
    root cause on both nodes, and no launcher calls the other node lost."""
    job = Job(hosts, ["loop", "120"], {"RANKWISE_HEARTBEAT_TIMEOUT": "0"})
    pids = _ready(job)
    os.kill(pids[3], signal.SIGKILL)
    assert [job.wait_exit(n, 60) for n in range(2)] == [137, 137], job.text()
    assert "stopped answering" not in job.text(), job.text()
    assert "Root cause (on another node): rank 3 (node 1) killed by SIGKILL" in job.text(0), \
        job.text(0)
