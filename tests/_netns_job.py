"""Runs a 2-node x 2-rank ``rankwise run`` job on simulated hosts and records what happens.

Each launcher's output is read by a thread into a list of ``(monotonic time, line)``, so a
test waits for a line (``wait_for``) with a deadline instead of sleeping.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _netns import SimHosts

WORKER = str(Path(__file__).parent / "launch_scripts" / "netns_worker.py")
PORT = 29517


class Job:
    """Two launchers (node 0 on host 0 hosting the store, node 1 on host 1)."""

    def __init__(self, hosts: SimHosts, worker_args: Sequence[str], env: dict[str, str],
                 nproc: int = 2, extra: Sequence[str] = (), nnodes: str = "2",
                 worker: str | None = None, script: str | None = None) -> None:
        """``worker``: a script to run under torchrun instead of ``WORKER`` under rankwise;
        ``script``: one to run under rankwise instead of ``WORKER``."""
        self.hosts = hosts
        self.lines: list[tuple[float, int, str]] = []
        self._cv = threading.Condition()
        self.launchers: list[subprocess.Popen[bytes]] = []
        full_env = {**os.environ, "RANKWISE_TOKEN": "netns-test-token", **env}
        for node in range(2):
            launcher = ["rankwise", "run"] if worker is None else ["torch.distributed.run"]
            cmd = [sys.executable, "-m", *launcher, "--nnodes", nnodes,
                   "--nproc-per-node", str(nproc), "--node-rank", str(node),
                   "--master-addr", hosts.addr(0), "--master-port", str(PORT), *extra,
                   worker or script or WORKER, *worker_args]
            proc = hosts.popen(node, cmd, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
            self.launchers.append(proc)
            threading.Thread(target=self._pump, args=(node, proc), daemon=True).start()

    def _pump(self, node: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            with self._cv:
                self.lines.append((time.monotonic(), node, raw.decode(errors="replace").rstrip()))
                self._cv.notify_all()

    def wait_for(self, pred: Callable[[list[str]], bool], timeout: float) -> bool:
        """Wait until ``pred(all lines so far)`` holds; False at the deadline."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred([line for _, _, line in self.lines]):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def count(self, word: str) -> Callable[[list[str]], bool]:
        return lambda lines: sum(line.startswith(word) for line in lines)  # type: ignore[return-value]

    def first_time(self, word: str) -> list[tuple[float, int, str]]:
        with self._cv:
            return [entry for entry in self.lines if word in entry[2]]

    def wait_exit(self, node: int, timeout: float) -> int | None:
        try:
            return self.launchers[node].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self, node: int | None = None) -> str:
        with self._cv:
            return "\n".join(f"[node {n}] {line}" for _, n, line in self.lines
                             if node is None or n == node)
