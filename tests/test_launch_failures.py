"""Real processes under `rankwise run`: each kind of rank failure is reported and cleaned up.

In every case: the launcher ends within a bound, prints one summary naming the root cause,
exits with that rank's exit code, the survivors' finally blocks ran, and no process of the job
(workers and their grandchildren) is left.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from launch_scripts.helpers import (
    JOB,
    SCRIPTS,
    assert_no_leftovers,
    read_lines_until,
    run_launcher,
    start_launcher,
    wait_dead,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]

BASE = ("-n", "4", "--grace", "0.5", "--no-prefix", JOB, "--grandchild")


@pytest.mark.parametrize(
    ("mode", "code", "status"),
    [
        ("raise", 1, "exit code 1"),
        ("exit3", 3, "exit code 3"),
        ("sigkill", 137, "killed by SIGKILL"),
    ],
)
def test_rank_failure(tmp_path: Path, mode: str, code: int, status: str) -> None:
    res = run_launcher(*BASE, "--out", str(tmp_path), "--fail-rank", "2", "--mode", mode,
                       "--wait", "60", timeout=40)
    assert res.returncode == code, res.stderr
    assert res.stderr.count("rankwise run: job failed") == 1, res.stderr
    summary = res.stderr[res.stderr.index("Root cause"):]
    assert "rank       : 2 " in summary
    assert status in summary
    if mode == "raise":
        assert "ValueError: boom from rank 2" in summary
        assert 'job.py", line' in summary  # the rank's own traceback
    for rank in (0, 1, 3):
        assert (tmp_path / f"finally_{rank}_0").exists(), f"rank {rank} finally did not run"
    assert_no_leftovers(tmp_path)


def test_stopped_rank(tmp_path: Path) -> None:
    """A SIGSTOPped rank hangs; the survivors' own bounded waits fail, then it is torn down."""
    res = run_launcher(*BASE, "--out", str(tmp_path), "--fail-rank", "1", "--mode", "sigstop",
                       "--wait", "2", timeout=40)
    assert res.returncode == 1, res.stderr
    assert "DistTimeout" in res.stderr
    assert "was stopped (SIGSTOP" in res.stderr
    for rank in (0, 2, 3):
        assert (tmp_path / f"finally_{rank}_0").exists()
    assert_no_leftovers(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_reaches_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    proc = start_launcher(*BASE, "--out", str(tmp_path), "--wait", "60")
    try:
        read_lines_until(proc, lambda line: line.startswith("READY"), 4, timeout=30)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err
    for rank in range(4):
        assert (tmp_path / f"finally_{rank}_0").exists()
    assert_no_leftovers(tmp_path)


def test_sigkilled_launcher_leaves_no_workers(tmp_path: Path) -> None:
    proc = start_launcher("-n", "2", "--no-prefix", JOB, "--out", str(tmp_path), "--wait", "60")
    try:
        read_lines_until(proc, lambda line: line.startswith("READY"), 2, timeout=30)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    workers = [int(p.read_text()) for p in tmp_path.glob("pid_?_0")]
    assert len(workers) == 2
    # PDEATHSIG: the kernel kills the workers when their launcher dies.
    assert all(wait_dead(w, 10.0) for w in workers)


def test_restart_recovers_from_first_attempt_failure(tmp_path: Path) -> None:
    res = run_launcher("-n", "2", "--grace", "0.5", "--max-restarts", "1", "--no-prefix", JOB,
                       "--out", str(tmp_path), "--fail-rank", "1", "--fail-once", timeout=40)
    assert res.returncode == 0, res.stderr
    assert "restarting the group (restart 1 of 1)" in res.stderr
    assert (tmp_path / "env_1_1.json").exists()
    assert_no_leftovers(tmp_path)


def test_restarts_exhausted_reports_failure(tmp_path: Path) -> None:
    res = run_launcher("-n", "2", "--grace", "0.5", "--max-restarts", "1", "--no-prefix", JOB,
                       "--out", str(tmp_path), "--fail-rank", "0", "--mode", "exit3", timeout=40)
    assert res.returncode == 3, res.stderr
    assert "1 of 1 restarts used" in res.stderr


def test_failure_report_is_printed_once(tmp_path: Path) -> None:
    """Issue 14 item 6: the traceback appears once (the summary), each rank says one line."""
    res = run_launcher("-n", "2", "--grace", "0.5", "--no-prefix", JOB, "--out", str(tmp_path),
                       "--fail-rank", "1", "--mode", "raise", "--wait", "60", timeout=40)
    assert res.returncode == 1, res.stderr
    output = res.stdout + res.stderr
    assert output.count("Traceback (most recent call last)") == 1, output
    assert output.count("rankwise run: job failed") == 1, output
    rank_lines = [ln for ln in output.splitlines() if "(traceback: in the launcher's summary)" in ln]
    # the failing rank, and rank 0 only if the failure reached it as an exception
    assert 1 <= len(rank_lines) <= 2, output
    assert rank_lines[0].startswith("rank 1: ValueError: boom from rank 1"), rank_lines
    report = output[output.index("=" * 72):]
    assert len(report.splitlines()) <= 25, report  # was ~170 lines for 2 ranks
    assert "ValueError: boom from rank 1" in report


def test_rank_out_of_descriptors_at_init_is_the_root_cause(tmp_path: Path) -> None:
    """`ulimit -n 64` with all but 2 taken on rank 1: it raises at once naming the limit,
    the others raise RendezvousError naming it, and the summary leads with it (before:
    a silent retry until the 1800 s init timeout)."""
    # grace 3 s: the others look for ended peers after a quiet second (mesh._QUIET)
    res = run_launcher("-n", "3", "--grace", "3", "--no-prefix",
                       str(SCRIPTS / "nofile_worker.py"), timeout=40)
    assert res.returncode == 1, res.stderr
    summary = res.stderr[res.stderr.index("Root cause (first failure)"):]
    assert "rank       : 1 " in summary, summary
    assert "too many open files: RLIMIT_NOFILE is 64" in summary, summary
    for rank in (0, 2):
        assert f"rank {rank}: exit code 1, raised RendezvousError: rank {rank}: rank 1 ended" \
            in summary, summary
