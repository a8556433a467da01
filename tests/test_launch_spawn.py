"""rankwise.spawn behaves like torch.multiprocessing.spawn, and never leaves a child behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "launch_scripts"))

import spawn_fns
from launch_scripts.helpers import assert_no_leftovers

from rankwise.errors import DistTimeout, PeerFailure
from rankwise.launch.spawn import (
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def test_spawn_runs_fn_with_index(tmp_path: Path) -> None:
    assert spawn(spawn_fns.write_rank, args=(str(tmp_path),), nprocs=2) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"]


def test_raise_carries_rank_and_traceback(tmp_path: Path) -> None:
    with pytest.raises(ProcessRaisedException) as info:
        spawn(spawn_fns.fail, args=("raise", str(tmp_path)), nprocs=3)
    exc = info.value
    assert isinstance(exc, PeerFailure)
    assert exc.error_index == 1 and exc.rank == 1
    assert "ValueError: spawned rank 1 broke" in exc.remote_traceback
    assert "Process 1 terminated with the following error" in str(exc)
    assert_no_leftovers(tmp_path)


@pytest.mark.parametrize(("mode", "code", "name"), [("exit", 4, None), ("kill", -9, "SIGKILL")])
def test_exit_and_signal(tmp_path: Path, mode: str, code: int, name: str | None) -> None:
    with pytest.raises(ProcessExitedException) as info:
        spawn(spawn_fns.fail, args=(mode, str(tmp_path)), nprocs=2)
    assert info.value.error_index == 1
    assert info.value.exit_code == code and info.value.signal_name == name
    assert_no_leftovers(tmp_path)


def test_join_false_and_timeout(tmp_path: Path) -> None:
    ctx = spawn(spawn_fns.fail, args=("none", str(tmp_path)), nprocs=1, join=False, timeout=1.0)
    assert isinstance(ctx, ProcessContext)
    assert len(ctx.processes) == 1
    with pytest.raises(DistTimeout, match=r"processes \[0\] still running"):
        while not ctx.join(0.5):
            pass
    assert_no_leftovers(tmp_path)
