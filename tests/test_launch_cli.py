"""CLI spellings, output prefixing, log files, -m modules and the token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_scripts.helpers import JOB, run_launcher

from rankwise.cli import parse_run_args

pytestmark = pytest.mark.slow


def test_torchrun_spellings_parse() -> None:
    opts = parse_run_args(["--nproc_per_node", "3", "--nnodes", "1:4", "--node_rank", "2",
                           "--rdzv_endpoint", "10.0.0.1:2345", "--max_restarts", "2", "x.py", "--lr", "1"])
    assert (opts.nproc, opts.min_nodes, opts.max_nodes, opts.node_rank) == (3, 1, 4, 2)
    assert (opts.master_addr, opts.master_port, opts.max_restarts) == ("10.0.0.1", 2345, 2)
    assert opts.cmd[-3:] == ["x.py", "--lr", "1"]


def test_start_gate_is_on_unless_turned_off() -> None:
    assert parse_run_args(["x.py"]).start_together is True
    assert parse_run_args(["--no-start-gate", "x.py"]).start_together is False
    assert parse_run_args(["--no_start_gate", "x.py"]).start_together is False


def test_several_nodes_need_a_port() -> None:
    with pytest.raises(SystemExit):
        parse_run_args(["--nnodes", "2", "x.py"])


@pytest.mark.procs
def test_prefix_logs_token(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = run_launcher("-n", "2", "--prefix", "--log-dir", str(logs), "--tee", "--rdzv-id", "r",
                       "--token", "s3cret", JOB, "--out", str(tmp_path), timeout=30)
    assert res.returncode == 0, res.stderr
    assert "[rank 0] READY 0" in res.stdout and "[rank 1] READY 1" in res.stdout
    assert (logs / "r" / "attempt_0" / "1" / "stdout.log").read_text() == "READY 1\n"
    env = json.loads((tmp_path / "env_0_0.json").read_text())
    assert env["RANKWISE_TOKEN"] == "s3cret"  # the store demanded it: the worker connected


@pytest.mark.procs
def test_module_and_no_prefix(tmp_path: Path) -> None:
    res = run_launcher("-n", "2", "--no-prefix", "-m", "platform", timeout=30)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2 and "[rank" not in res.stdout
