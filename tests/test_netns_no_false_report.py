"""No false report of a lost node: a rank holding the GIL for 20 s on a loaded machine, a
slow lossy link, and 64 ranks starting at once on this machine. Default settings.

2 simulated hosts under ``rankwise run`` (``tests/_netns.py``). Each job must end with exit
code 0 on both nodes and no rank may raise: the launchers' node beats (3.5 s) must not take
a slow link or a starved machine for a lost node, and the ranks' own heartbeats (60 s under
``rankwise run``) must not take a rank that holds the GIL for a frozen one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _netns import SimHosts, two_hosts, unavailable
from _netns_job import Job
from _netns_netem import make_lossy
from _netns_netem import unavailable as no_netem

_WHY = unavailable()
pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(_WHY), reason=f"no simulated hosts: {_WHY}")]

DEFAULTS = ("RANKWISE_NODE_TIMEOUT", "RANKWISE_HEARTBEAT_TIMEOUT")

hosts = pytest.fixture(two_hosts, name="hosts")


def _quiet_run(job: Job, ranks: int, timeout: float) -> None:
    """Both launchers exit 0, every rank says ``done``, none raised, no node was lost."""
    codes = [job.wait_exit(n, timeout) for n in range(2)]
    text = job.text()
    assert codes == [0, 0], text
    assert sum(line.startswith("done ") for _, _, line in job.lines) == ranks, text
    assert "raised " not in text and "stopped answering" not in text, text
    # the beats were heard (a launcher says so when a node's never come): not vacuous
    assert "no UDP beats" not in text, text


@pytest.fixture(name="defaults")
def _defaults() -> None:
    for name in DEFAULTS:  # the launchers must run with the defaults
        if os.environ.get(name):
            pytest.skip(f"{name} is set in the test's environment")


@pytest.mark.usefixtures("defaults")
def test_a_rank_holding_the_gil_for_20s_on_a_loaded_machine_is_not_reported(
        hosts: SimHosts) -> None:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(3)]
    try:
        job = Job(hosts, ["gil", "20"], {})
        _quiet_run(job, 4, 150)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.usefixtures("defaults")
@pytest.mark.skipif(bool(no_netem()), reason=f"no lossy link: {no_netem()}")
def test_a_slow_lossy_link_is_not_a_lost_node(hosts: SimHosts) -> None:
    link = make_lossy(hosts, 1, delay=0.3, jitter=0.1, loss=0.01)
    job = Job(hosts, ["loop", "25"], {})
    _quiet_run(job, 4, 200)
    print(f"lossy link: {link.frames} frames (h1->bridge, bridge->h1), {link.dropped} dropped")
    assert sum(link.dropped) > 0  # the loss was there


@pytest.mark.usefixtures("defaults")
def test_64_ranks_starting_at_once_give_no_false_report(hosts: SimHosts) -> None:
    job = Job(hosts, ["loop", "3"], {}, nproc=32)
    _quiet_run(job, 64, 250)
