"""The launcher holds each worker stopped until the node's last one is spawned
(launch/gate.py), then releases all: they run, exit and are reaped as usual, and the
gate's stops are not reported as the user's SIGSTOP."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rankwise.launch.agent import AgentConfig, LocalAgent

pytestmark = pytest.mark.procs

_SCRIPT = "import os, sys; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _becomes_stopped(pid: int, within: float = 5.0) -> bool:
    """SIGSTOP takes effect when the target next runs: look until it has, bounded."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if _state(pid) == "T":
            return True
        time.sleep(0.01)
    return False


def _agent(tmp_path: Path, together: bool, nproc: int = 3) -> LocalAgent:
    out = tmp_path / "out"
    out.mkdir()
    cfg = AgentConfig(cmd=[sys.executable, "-c", _SCRIPT, str(out)], nproc=nproc,
                      master_addr="127.0.0.1", master_port=1, run_id="gate",
                      run_dir=str(tmp_path), start_together=together)
    return LocalAgent(cfg)


@pytest.mark.parametrize("together", [True, False], ids=["gated", "ungated"])
def test_workers_wait_for_the_last_spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         together: bool) -> None:
    agent = _agent(tmp_path, together)
    seen: list[bool] = []
    spawn = LocalAgent._spawn

    def spawn_and_look(self: LocalAgent, local_rank: int, attempt: int) -> Any:
        if local_rank == 2:  # before the last spawn: is the first worker held?
            seen.append(_becomes_stopped(self._workers[0].proc.pid, 5.0 if together else 0.3))
        return spawn(self, local_rank, attempt)

    monkeypatch.setattr(LocalAgent, "_spawn", spawn_and_look)
    result = agent.run_attempt(0)
    assert seen == [together]
    assert [o.returncode for o in result.outcomes] == [0, 0, 0]
    assert all(o.stopped_at is None for o in result.outcomes)  # the gate's stop is no news
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0", "1", "2"]


def test_a_spawn_failure_releases_and_reaps_the_held_ones(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(tmp_path, True)
    spawn = LocalAgent._spawn

    def fail_last(self: LocalAgent, local_rank: int, attempt: int) -> Any:
        if local_rank == 2:
            raise OSError("no such program")
        return spawn(self, local_rank, attempt)

    monkeypatch.setattr(LocalAgent, "_spawn", fail_last)
    with pytest.raises(OSError, match="no such program"):
        agent.run_attempt(0)
    # the two held workers were released, then killed and reaped: none is left behind
    assert [w.proc.returncode is not None for w in agent._workers] == [True, True]
