"""In-place recovery across simulated hosts (network namespaces, 2 hosts x 2 ranks): a
whole node is SIGKILLed (its launcher too) under ``--on-failure=continue``; the two ranks
left shrink, resume within 5 s, and finish with equal parameters, in the same processes."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from _netns import SimHosts, two_hosts, unavailable
from _netns_job import Job
from _procs import ROOT

_WHY = unavailable()
pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.torch,
              pytest.mark.skipif(bool(_WHY), reason=f"no simulated hosts: {_WHY}")]

EXAMPLE = str(ROOT / "examples" / "recovery_ddp.py")


hosts = pytest.fixture(two_hosts, name="hosts")


def test_a_lost_node_leaves_the_other_node_training_in_the_same_processes(
        hosts: SimHosts) -> None:
    pytest.importorskip("torch")
    job = Job(hosts, ["--victim", "-1", "--steps", "40", "--step-delay", "0.1"], {},
              extra=["--on-failure=continue"], script=EXAMPLE)
    assert job.wait_for(lambda ls: any(line.startswith("at step 10 ") for line in ls), 120), \
        job.text()
    survivors = set(hosts.pids(0))
    killed = time.time()
    for pid in hosts.pids(1):
        os.kill(pid, signal.SIGKILL)
    assert job.wait_exit(0, 90) == 3, job.text()
    text = job.text(0)
    resumed = [float(t) - killed for t in re.findall(r"resumed at step \d+ .*\(t=([0-9.]+)\)", text)]
    print(f"kill -> resumed: {', '.join(f'{s:.2f}s' for s in resumed)}")  # docs/recovery.md
    assert len(resumed) == 2 and max(resumed) < 5.0, (resumed, text)
    assert "lost ranks [2, 3]" in text, text
    assert "PASS: parameters identical on 2 ranks after 40 steps (world size 2" in text, text
    assert "restarting" not in text
    assert survivors  # the same processes went on: nothing on host 0 was started again


def test_a_lost_rank_is_replaced_and_the_job_ends_at_four_ranks_across_hosts(
        hosts: SimHosts) -> None:
    pytest.importorskip("torch")
    job = Job(hosts, ["--victim", "2", "--kill-at", "10", "--steps", "16", "--grow"], {},
              extra=["--on-failure=continue", "--respawn", "1"], script=EXAMPLE)
    # both launchers: the survivors noted the dropped rank in the store
    assert [job.wait_exit(n, 150) for n in range(2)] == [3, 3], job.text()
    text = job.text()
    assert "lost ranks [2]" in text and re.search(r"joined the running job at step \d+ \(4 ranks\)", text)
    assert "PASS: parameters identical on 4 ranks after 16 steps (world size 4" in text, text
