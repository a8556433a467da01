"""A lost node is raised on every reachable rank within 5 s, with its cause; default settings.

2 simulated hosts x 2 ranks under ``rankwise run`` (``tests/_netns.py``), each rank in a
loop of checked all_reduces. The launchers' UDP beats (``launch.beacon``, 3.5 s) find the
lost node and each launcher tells its own ranks at once (``core.heartbeat.LauncherNews``);
the ranks' own heartbeats (60 s under ``rankwise run``) play no part. Each test prints
its detection times (the fault to each rank's raise), for docs/heartbeats.md.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _netns import SimHosts, two_hosts, unavailable
from _netns_job import Job

_WHY = unavailable()
pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(200),
              pytest.mark.skipif(bool(_WHY), reason=f"no simulated hosts: {_WHY}")]

BOUND = 5.0  #: seconds from the fault to the last reachable rank's raise
DEFAULTS = ("RANKWISE_NODE_TIMEOUT", "RANKWISE_HEARTBEAT_TIMEOUT")  #: left unset: defaults

hosts = pytest.fixture(two_hosts, name="hosts")


def _start(hosts: SimHosts, mode: str = "loop") -> Job:
    for name in DEFAULTS:  # the launchers must run with the defaults
        assert not os.environ.get(name), f"{name} is set in the test's environment"
    job = Job(hosts, [mode, "150"], {})
    assert job.wait_for(lambda ls: sum(line.startswith("ready ") for line in ls) == 4, 90), \
        job.text()
    # the beacons learn each other's address and key through the launchers' store beats
    # (one a second): a node lost before that is the store watch's (15 s, docs/heartbeats.md).
    # Three beats' worth of running; under CI's load one second was once not enough
    time.sleep(3.0)
    return job


def _raised(job: Job, ranks: set[int], fault: float, what: str) -> dict[int, tuple[float, str]]:
    """Wait for ``ranks`` to raise; each one's seconds after ``fault`` and its message."""
    def done(lines: list[str]) -> bool:
        return {int(x.split()[1]) for x in lines if x.startswith("raised ")} >= ranks
    assert job.wait_for(done, 30), job.text()
    got: dict[int, tuple[float, str]] = {}
    for _, _, line in job.lines:
        if line.startswith("raised "):
            _, rank, when, message = line.split(" ", 3)
            got.setdefault(int(rank), (float(when) - fault, message))
    print(f"{what}: " + ", ".join(f"rank {r} {got[r][0]:.2f} s" for r in sorted(ranks)))
    for r in ranks:
        assert got[r][0] < BOUND, (r, got[r], job.text())
    return got


def _ends(job: Job) -> None:
    for n in range(2):
        if job.wait_exit(n, 30) is None:
            job.launchers[n].kill()
            pytest.fail(f"launcher {n} did not end\n{job.text()}")


def test_a_powered_off_node_is_raised_on_the_other_within_5s(hosts: SimHosts) -> None:
    job = _start(hosts)
    fault = time.monotonic()
    hosts.power_off(1)
    got = _raised(job, {0, 1}, fault, "power off")
    for _, message in got.values():
        assert message.startswith("PeerFailure: node 1 (h1, ranks 2-3) stopped answering"), \
            message
        assert "its launcher's beats stopped arriving" in message, message
    assert job.wait_exit(0, 30) == 1, job.text()
    assert "Root cause (the launcher ended the job): node 1 (h1, ranks 2-3) stopped " \
        "answering" in job.text(0), job.text(0)


def test_a_partition_both_ways_is_raised_on_both_sides_within_5s(hosts: SimHosts) -> None:
    job = _start(hosts)
    fault = time.monotonic()
    hosts.cut(1)
    got = _raised(job, {0, 1, 2, 3}, fault, "partition both ways")
    for rank, (_, message) in got.items():
        lost = "node 1 (h1, ranks 2-3)" if rank < 2 else "node 0 (h0, ranks 0-1)"
        assert message.startswith(f"PeerFailure: {lost} stopped answering"), message
    _ends(job)
    assert hosts.pids(0) == [] and hosts.pids(1) == []


@pytest.mark.parametrize("src", [0, 1])
def test_a_partition_one_way_is_raised_on_both_sides_within_5s(hosts: SimHosts,
                                                              src: int) -> None:
    """What host ``src`` sends to the other is lost, the other way still works: the side
    that hears nothing finds the silence, the other reads in its beats that it is not
    heard."""
    job = _start(hosts)
    fault = time.monotonic()
    hosts.cut_one_way(src, 1 - src)
    got = _raised(job, {0, 1, 2, 3}, fault, f"partition one way (from h{src})")
    for _, message in got.values():  # its launcher's news, or the other side's relayed
        assert message.startswith(("PeerFailure: node 1 (h1, ranks 2-3) stopped answering",
                                   "PeerFailure: node 0 (h0, ranks 0-1) stopped answering")), \
            message
    _ends(job)


def test_a_sigkilled_launcher_is_raised_on_the_other_node_within_5s(hosts: SimHosts) -> None:
    job = _start(hosts)
    fault = time.monotonic()
    job.launchers[1].send_signal(signal.SIGKILL)  # its ranks die of PR_SET_PDEATHSIG
    got = _raised(job, {0, 1}, fault, "launcher SIGKILL")
    for _, message in got.values():
        assert "rank 2" in message or "rank 3" in message or "node 1 (h1" in message, message
    assert job.wait_exit(0, 30) == 1, job.text()
    assert "Root cause (the launcher ended the job): node 1 (h1, ranks 2-3) died" \
        in job.text(0), job.text(0)
