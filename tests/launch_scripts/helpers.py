"""Shared helpers of the launcher tests: run `rankwise run` with hard timeouts, check /proc."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from _procs import ROOT, free_port, run, start

__all__ = ["JOB", "ROOT", "SCRIPTS", "TORCH_EXIT_ABORT", "alive", "assert_no_leftovers", "env", "free_port",
           "job_pids", "launcher_cmd", "marked_processes", "read_lines_until", "run_bounded",
           "run_launcher", "start_launcher", "torch_ok", "wait_dead"]

SCRIPTS = ROOT / "tests" / "launch_scripts"
JOB = str(SCRIPTS / "job.py")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANKWISE_TOKEN", None)
    return e


#: what torch's C++ runtime prints when a rank aborts at interpreter exit, after its work
TORCH_EXIT_ABORT = "terminate called without an active exception"


def torch_ok(returncode: int | None, stderr: str) -> bool:
    """A plain torch job ended well: exit 0, or 134 from torch's own abort at interpreter
    exit (gloo's threads; seen 1 run in 8 under torchrun too, same script, torch 2.13).
    The launcher reports that exit faithfully; the tests only refuse rankwise's failures."""
    return returncode == 0 or (returncode == 134 and TORCH_EXIT_ABORT in stderr)


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rankwise", "run", *args]


def run_launcher(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run the launcher to completion; a hard timeout kills it with its workers (and
    fails the test)."""
    return run(launcher_cmd(*args), env=env(), timeout=timeout)


def run_bounded(cmd: list[str], environ: dict[str, str],
                timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (another launcher: torchrun, a benchmark that starts ranks), stdout
    and stderr together; on timeout kill it with its ranks and fail the test."""
    return run(cmd, env=environ, timeout=timeout, merge_stderr=True)


def start_launcher(*args: str) -> subprocess.Popen[str]:
    return start(launcher_cmd(*args), env=env())


def read_lines_until(proc: subprocess.Popen[str], predicate: object, n: int,
                     timeout: float) -> list[str]:
    """Read stdout lines until ``n`` lines satisfy ``predicate`` (blocking in select)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    hits = 0
    fd = proc.stdout.fileno()
    buf = b""
    while hits < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"timed out waiting for output; got {seen!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"launcher closed stdout early; got {seen!r}")
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            text = line.decode()
            seen.append(text)
            if predicate(text):  # type: ignore[operator]
                hits += 1
    return seen


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pid: int, timeout: float) -> bool:
    """Block (pidfd + select, no polling) until ``pid`` exits; False on timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return not alive(pid)


def job_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("pid_*")]


def assert_no_leftovers(out: Path) -> None:
    pids = job_pids(out)
    assert pids, "the job recorded no pids"
    left = [p for p in pids if not wait_dead(p, 5.0)]
    assert not left, f"processes of the job still alive: {left}"


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``FAULT_MARKER=<marker>``: what a
    job under test started, grandchildren included (they inherit the environment)."""
    needle = f"FAULT_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found
