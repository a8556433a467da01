"""Elastic membership with real launchers on loopback: a node that arrives after the job's
rendezvous closed waits and is admitted at the next restart (``--nnodes MIN:MAX``)."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta

import pytest
from _procs import start
from launch_scripts.helpers import SCRIPTS, env, free_port, launcher_cmd, read_lines_until

from rankwise.store import TCPStore

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(90)]


def _late_node(*worker_args: str, alone: float = 0.0) -> tuple[int, str, int, str]:
    """Node 0 runs alone (``--nnodes 1:2``); node 1 arrives after the rendezvous closed and
    waits; ``alone`` seconds later node 0's rank is released. Each launcher's exit code and
    output."""
    port = free_port()
    common = ("-n", "1", "--nnodes", "1:2", "--max-restarts", "1", "--master-port", str(port),
              "--rdzv-id", "late", "--grace", "0.5", "--timeout", "20", "--no-prefix",
              str(SCRIPTS / "late_join.py"), *worker_args)
    first = start(launcher_cmd(*common), env=env(), merge_stderr=True)
    second: subprocess.Popen[str] | None = None
    try:
        seen0 = read_lines_until(first, lambda line: line.startswith("WAITING 0"), 1, timeout=30)
        second = start(launcher_cmd(*common), env=env(), merge_stderr=True)
        seen1 = read_lines_until(second, lambda line: "at the job's next restart" in line, 1,
                                 timeout=30)
        assert "already closed its rendezvous with 1 nodes" in seen1[-1], seen1
        time.sleep(alone)  # how long the job runs on one node: the fault, not a synchronization
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10)).set("release", "1")
        out0, _ = first.communicate(timeout=45)
        out1, _ = second.communicate(timeout=15)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
    return (first.returncode, "\n".join([*seen0, out0]), second.returncode,
            "\n".join([*seen1, out1]))


def test_late_node_joins_at_the_next_restart() -> None:
    """Node 0's rank fails once released; the restart's round admits node 1: 2 ranks, one
    all_reduce across both launchers, both exit 0."""
    code0, text0, code1, text1 = _late_node()
    assert code0 == 0 and code1 == 0, (text0, text1)
    assert "rendezvous round 1: 2 node(s), this is node 0; 2 ranks" in text0, text0
    joined = sorted(line for line in (text0 + "\n" + text1).splitlines()
                    if line.startswith("JOINED"))
    assert joined == ["JOINED 0 2 3", "JOINED 1 2 3"], (text0, text1)
    assert "WAITING 1" not in text1  # node 1 never ran attempt 0


def test_late_node_joins_after_the_job_ran_alone_for_a_while() -> None:
    """The same after 5 s on one node. Before, a round of one node had no node watch, its
    store counted as lost 3.5 s in, and the launcher refused to restart: "job failed (0 of
    1 restarts used)", and the waiting node was never admitted."""
    code0, text0, code1, text1 = _late_node(alone=5.0)
    assert code0 == 0 and code1 == 0, (text0, text1)
    assert "rendezvous round 1: 2 node(s), this is node 0; 2 ranks" in text0, text0


def test_late_node_not_needed_when_the_job_ends_without_a_restart() -> None:
    """Node 0's rank succeeds: no next round opens, and the waiting node is told the job is
    over at once (not after --timeout) and exits 0 without starting a rank."""
    code0, text0, code1, text1 = _late_node("ok")
    assert code0 == 0 and code1 == 0, (text0, text1)
    assert "this node was not needed" in text1, text1
    assert "rendezvous round 1" not in text0 + text1 and "JOINED" not in text0 + text1
