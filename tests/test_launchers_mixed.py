"""Issue 14 item 5: mixing launchers. A rankwise script runs under torchrun (it used to
wait the whole 1800 s timeout on torch's store and then blame the store; then it was
refused with one line), and a torch script under `rankwise run` says in one line what to
run instead."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import _procs
import pytest
from launch_scripts.helpers import env, free_port, run_bounded, run_launcher

pytestmark = pytest.mark.procs

pytest.importorskip("torch")

SCRIPT = """\
import os, sys
import numpy as np
import rankwise as dist

fail_rank, failing_attempts = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == fail_rank and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < failing_attempts:
    raise ValueError(f"bad batch on rank {rank}")
x = np.full(3, rank + 1.0, dtype=np.float32)
dist.all_reduce(x)
print(f"rank {rank} of {dist.get_world_size()}: {x.tolist()}", flush=True)
dist.destroy_process_group()
"""
FAILED = "PeerFailure: rank 1 failed: ValueError: bad batch on rank 1"


def _peer_told(out: str) -> bool:
    """Rank 0 raised ``FAILED``. Both ranks' tracebacks share one pipe, and Python writes
    an exception's type and its message in two writes, so rank 1's lines can land between
    them (seen in CI: ``rankwise.errors.PeerFailure  File ...`` then ``: rank 1 failed``)."""
    kind, message = FAILED.split(": ", 1)
    return FAILED in out or (f"rankwise.errors.{kind}" in out and f": {message}" in out)


def _torchrun(script: Path, fail_rank: int, failing_attempts: int = 1, *options: str
              ) -> tuple[subprocess.CompletedProcess[str], str]:
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), *options, str(script), str(fail_rank),
           str(failing_attempts)]
    environ = env()
    environ.pop("RANKWISE_LAUNCHED", None)  # torchrun's job, even inside `rankwise run`
    res = run_bounded(cmd, environ, 180)
    return res, res.stdout


def _all_reduced(out: str) -> bool:
    return all(f"rank {rank} of 2: [3.0, 3.0, 3.0]" in out for rank in (0, 1))


def test_rankwise_script_runs_under_torchrun(tmp_path: Path) -> None:
    """torchrun's agent serves torch's store at MASTER_PORT: rankwise's rendezvous runs on
    it (no second port), and the job runs as under `rankwise run`."""
    res, out = _torchrun(tmp_path / "train.py", -1)
    assert res.returncode == 0, out
    assert _all_reduced(out), out


def test_a_failing_rank_under_torchrun_reaches_its_peer(tmp_path: Path) -> None:
    """torchrun tells no rank of another's failure; rankwise's control plane does, at once."""
    res, out = _torchrun(tmp_path / "train.py", 1)
    assert res.returncode != 0, out
    assert _peer_told(out), out
    assert "rank 0 of 2" not in out


def test_torchrun_restarts_a_failed_job_on_a_fresh_rendezvous(tmp_path: Path) -> None:
    """torchrun's restart runs the workers again on the same store: the new attempt's
    rendezvous (keyed by TORCHELASTIC_RESTART_COUNT) must not meet the failed one's."""
    res, out = _torchrun(tmp_path / "train.py", 1, 1, "--max-restarts", "1")
    assert res.returncode == 0, out
    assert _peer_told(out), out  # the first attempt
    assert _all_reduced(out), out  # the second


def test_torchrun_without_torch_says_what_to_run(tmp_path: Path) -> None:
    """torchrun's variables but no importable torch (another interpreter): one clear line,
    before any connection, instead of a wait on a store rankwise cannot speak to."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.modules['torch'] = None  # not importable\n"
                      "import rankwise as dist\ndist.init_process_group('gloo')\n")
    child = env() | {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True",
                     "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    child.pop("RANKWISE_LAUNCHED", None)
    started = time.monotonic()
    res = _procs.run([sys.executable, str(script)], env=child, timeout=120, cwd=None)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "started by torchrun" in out and "`rankwise run`" in out, out
    assert time.monotonic() - started < 60, out


TORCH_SCRIPT = ("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                "print('joined')\n")
FIX = "import rankwise.torch"


def test_torch_script_under_rankwise_run_joins_and_names_the_fix(tmp_path: Path) -> None:
    """A torch-only script under `rankwise run` (which always has a token on one node):
    since issue 36 its TCPStore client is served by torch's own store behind the port
    (launch.torch_store), so it joins; one line says what it does not get, and the fix.
    ``--checks=off``: the script as asked (with the checks on, its gloo is taken over:
    tests/test_launch_torch_checks.py)."""
    script = tmp_path / "train.py"
    script.write_text(TORCH_SCRIPT)
    res = run_launcher("--checks=off", "-n", "2", str(script), timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    said = [ln for ln in out.splitlines() if ln.startswith("rankwise run: ranks use torch")]
    assert len(said) == 1 and FIX in said[0], out
    assert out.count("joined") == 2, out


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
            _procs.run([sys.executable, "-c", KNOCK, str(server.port)], env=knocker_env,
                       timeout=60, cwd=None)
    assert len(said) == 1 and FIX in said[0]
    assert agent.aborted.is_set() == ends
    assert all(FIX in text for text in agent.aborts)
