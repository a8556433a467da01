"""The one way tests start processes, each run bounded, and the guard that keeps the fast
loop fast.

- ``run_ranks`` / ``free_port`` / ``RankResult``: N Python ranks with a hard timeout
  (``rankwise.testing``, shipped for users' tests too).
- ``run`` / ``start`` / ``wait_all``: a command (the launcher, a script) in its own
  session; past its timeout the whole session - its ranks and their children too - is
  killed and the test fails. ``kill_started`` (run by conftest after every test) kills
  what a test started here and left running, after the test's own checks.
- ``ProcsGuard``: conftest's check that only tests marked ``procs`` start processes.
"""

from __future__ import annotations

import _posixsubprocess
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rankwise.testing import RankResult, free_port, run_ranks

__all__ = ["ROOT", "SRC", "ProcsGuard", "RankResult", "free_port", "kill_started", "run",
           "run_ranks", "start", "wait_all"]

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")

_started: list[subprocess.Popen[Any]] = []
_started_lock = threading.Lock()


def start(cmd: Sequence[str], *, env: dict[str, str] | None = None,
          cwd: str | Path | None = ROOT, merge_stderr: bool = False,
          stdin: int | None = None, text: bool = True) -> subprocess.Popen[Any]:
    """Start ``cmd`` in its own session, stdout and stderr piped (or merged into stdout).

    Not waited for: pair it with ``wait_all`` (or read it and ``kill``); whatever still
    runs when the test ends is killed, with its session, by ``kill_started``."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=text, start_new_session=True)
    with _started_lock:
        _started.append(proc)
    return proc


def _kill_session(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: str | Path | None = ROOT, merge_stderr: bool = False, input: str | None = None,
        check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion, like ``subprocess.run(capture_output=True, text=True)``;
    past ``timeout`` seconds kill its whole session (grandchildren too) and raise
    ``subprocess.TimeoutExpired``. Processes it leaves behind on a normal exit are left
    for the test to find (leftover checks) and killed after it."""
    proc = start(cmd, env=env, cwd=cwd, merge_stderr=merge_stderr,
                 stdin=None if input is None else subprocess.PIPE)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err or "")
    if check:
        done.check_returncode()
    return done


def wait_all(procs: Sequence[subprocess.Popen[str]],
             timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process within one shared ``timeout``; if one overruns, kill every
    session and raise ``AssertionError`` naming the stragglers (no test hangs)."""
    import time

    deadline = time.monotonic() + timeout
    out: list[tuple[int, str, str]] = []
    hung = []
    for i, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill_session(q)
            so, se = p.communicate(timeout=10)
            hung.append(i)
        out.append((p.returncode, so, se or ""))
    if hung:
        raise AssertionError(f"processes {hung} still running after {timeout}s (killed):\n"
                             + "\n".join(f"--- {i} ---\n{out[i][2][-3000:]}" for i in hung))
    return out


def kill_started() -> None:
    """Kill (with their sessions) the processes started here that still run; reap them."""
    with _started_lock:
        procs = list(_started)
        _started.clear()
    for p in procs:
        if p.poll() is None:
            _kill_session(p)
        _kill_session(p)  # what it started and left in its session
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                stream.close()


class ProcsGuard:
    """Fails process starts (subprocess, multiprocessing, fork) made while a test that is
    not marked ``procs`` runs, and remembers them, so that a start in a thread or one
    whose error the test swallowed still fails the test."""

    def __init__(self) -> None:
        self._test: str | None = None
        self._allowed = True
        self._seen: dict[str, list[str]] = {}

    def install(self) -> None:
        # subprocess binds fork_exec at import (3.11+); multiprocessing looks it up
        for owner, name in ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"),
                            (os, "fork"), (os, "forkpty"), (os, "posix_spawn"),
                            (os, "posix_spawnp")):
            real = getattr(owner, name, None)
            if real is not None and not getattr(real, "_procs_guarded", False):
                setattr(owner, name, self._guarded(real, f"{owner.__name__}.{name}"))

    def enter(self, nodeid: str, allowed: bool) -> None:
        self._test, self._allowed = nodeid, allowed

    def leave(self) -> None:
        self._test, self._allowed = None, True

    def violations(self, nodeid: str) -> list[str]:
        return self._seen.pop(nodeid, [])

    def _guarded(self, real: Callable[..., Any], what: str) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            test = self._test
            if test is not None and not self._allowed:
                self._seen.setdefault(test, []).append(what)
                raise RuntimeError(f"{test} started a process ({what}) but is not marked "
                                   "`procs`")
            return real(*args, **kwargs)

        guarded._procs_guarded = True  # type: ignore[attr-defined]
        return guarded
