"""The test suite's own process rules (``tests/_procs.py``, conftest): a run past its
timeout takes its grandchildren with it, and a test without the ``procs`` mark cannot
start a process unseen."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import _procs
import pytest
from _procs import ProcsGuard
from launch_scripts.helpers import alive, wait_dead

#: a child that starts a grandchild, records its pid, and both sleep far past the bound
_FAMILY = ("import subprocess, sys, time\n"
           "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
           "open(sys.argv[1], 'w').write(str(g.pid))\n"
           "time.sleep(60)\n")


@pytest.mark.procs
def test_a_run_past_its_timeout_is_killed_with_its_grandchildren(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _procs.run([sys.executable, "-c", _FAMILY, str(pid_file)], timeout=5)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    assert wait_dead(grandchild, 10.0), f"grandchild {grandchild} outlived the bound"


@pytest.mark.procs
def test_what_a_test_leaves_running_is_killed_after_it(tmp_path: Path) -> None:
    proc = _procs.start([sys.executable, "-c", "import time; time.sleep(60)"])
    assert alive(proc.pid)
    _procs.kill_started()  # what conftest runs after every test
    assert wait_dead(proc.pid, 10.0)


def test_an_unmarked_start_is_refused_and_remembered() -> None:
    guard = ProcsGuard()
    start = guard._guarded(lambda: "started", "fake.spawn")
    guard.enter("t::unmarked", allowed=False)
    with pytest.raises(RuntimeError, match="not marked `procs`"):
        start()
    guard.enter("t::marked", allowed=True)
    assert start() == "started"
    guard.leave()
    assert start() == "started"  # between tests (collection, session fixtures)
    assert guard.violations("t::unmarked") == ["fake.spawn"]
    assert guard.violations("t::marked") == []


def test_every_way_to_start_a_process_is_guarded() -> None:
    import _posixsubprocess
    import os

    for fn in (subprocess._fork_exec, _posixsubprocess.fork_exec,  # type: ignore[attr-defined]
               os.fork, os.posix_spawn):
        assert getattr(fn, "_procs_guarded", False), fn
