"""Issue 14 item 5: a rankwise script under torchrun says in one line what to run instead
(it used to wait the whole 1800 s timeout on torch's store and then blame the store)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launch_scripts.helpers import env, free_port, run_launcher

pytest.importorskip("torch")

SCRIPT = "import rankwise as dist\ndist.init_process_group('gloo')\nprint('joined')\n"


def test_rankwise_script_under_torchrun_says_what_to_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "joined" not in out
    lines = [ln for ln in out.splitlines() if "started by torchrun" in ln]
    assert lines, out
    assert "start it with `rankwise run` instead" in lines[0]


TORCH_SCRIPT = ("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                "print('joined')\n")
FIX = "import rankwise.torch"


def test_torch_script_under_rankwise_run_ends_the_job_naming_the_fix(tmp_path: Path) -> None:
    """A torch-only script under `rankwise run` (which always has a token on one node):
    its own workers' TCPStore knocks end the job in seconds with the fix named, where
    torch's client used to retry for 30 minutes with a C++ traceback per try."""
    script = tmp_path / "train.py"
    script.write_text(TORCH_SCRIPT)
    started = time.monotonic()
    res = run_launcher("-n", "2", str(script), timeout=120)
    elapsed = time.monotonic() - started
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    said = [ln for ln in out.splitlines() if ln.startswith("rankwise run: a torch.distributed")]
    assert len(said) == 1 and FIX in said[0] and "torchrun" in said[0], out
    assert "Root cause (the launcher ended the job): a torch.distributed TCPStore" in out
    assert "joined" not in out
    assert elapsed < 60, f"took {elapsed:.1f}s"  # torch start-up on a loaded machine


class _Agent:
    """Stands in for the launcher's agent: records what the alarm asks it to end."""

    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.aborted = threading.Event()

    def abort(self, text: str) -> None:
        self.aborts.append(text)
        self.aborted.set()


KNOCK = ("import os, socket, sys\n"
         "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
         "s.sendall(b'\\x00' + (0x3C85F7CE).to_bytes(4, 'little'))  # torch's TCPStore hello\n"
         "s.recv(1)\n")


@pytest.mark.parametrize(("token", "of_job", "ends"), [
    ("secret", False, False),  # a stranger must not abort an authenticated job
    ("secret", True, True),    # one of the job's own workers: it can never join
    (None, False, True),       # no token: nothing protected, end the doomed job
])
def test_foreign_knock_ends_the_job_only_when_it_may(token: str | None, of_job: bool,
                                                     ends: bool) -> None:
    from rankwise.launch.foreign_alarm import ForeignAlarm
    from rankwise.launch.watchdog import MARKER_ENV
    from rankwise.store import TCPStoreServer

    said: list[str] = []
    alarm = ForeignAlarm(token, said.append)
    agent = _Agent()
    alarm.agent, alarm.marker = agent, "job-marker-" + str(os.getpid())  # type: ignore[assignment]
    knocker_env = env()
    if of_job:
        knocker_env[MARKER_ENV] = alarm.marker
    with TCPStoreServer("127.0.0.1", 0, token=token, on_foreign=alarm) as server:
        for _ in range(2):  # two knocks: the line is said once
            subprocess.run([sys.executable, "-c", KNOCK, str(server.port)], env=knocker_env,
                           timeout=60, check=False, capture_output=True)
    assert len(said) == 1 and FIX in said[0]
    assert agent.aborted.is_set() == ends
    assert all(FIX in text for text in agent.aborts)
