"""Inside a launched worker: the error file, SIGTERM -> finally, and (with the core) PeerFailure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _procs
import pytest
from launch_scripts.helpers import SCRIPTS, env, run_launcher

from rankwise.launch.summary import WorkerOutcome, blamed_elsewhere, format_summary, root_cause
from rankwise.launch.worker import one_line

HOOKED = "from rankwise.launch.worker import install_worker_hooks as h; h(); h()\n"


def _run(code: str, error_file: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    e = {**env(), "RANKWISE_ERROR_FILE": str(error_file), "RANK": "5"}
    return _procs.run([sys.executable, "-c", HOOKED + code], env=e, timeout=30, cwd=None,
                      **kw)  # type: ignore[arg-type]


@pytest.mark.procs
def test_uncaught_exception_is_written_once_and_still_printed(tmp_path: Path) -> None:
    before = time.time()
    res = _run("def f():\n    raise KeyError('k')\nf()", tmp_path / "e.json")
    assert res.returncode == 1 and "KeyError: 'k'" in res.stderr  # previous hook still ran
    rec = json.loads((tmp_path / "e.json").read_text())
    assert rec["rank"] == 5 and rec["exc_type"] == "KeyError" and rec["message"] == "'k'"
    assert "in f" in rec["traceback"] and rec["pid"] > 0 and rec["timestamp"] >= before
    assert rec["where"] == "<string>:3 in f"  # the user's innermost line, for one-line reports


def test_one_line_cuts_a_long_message_at_a_word_and_says_where() -> None:
    long = "rank 0 called all_reduce(float32 x 5, op=SUM) at t.py:3 in f, " * 8
    text = one_line("CollectiveMismatch", long + "\nsecond line", "t.py:3 in f")
    assert text.startswith("CollectiveMismatch: rank 0 called") and "second line" not in text
    assert text.endswith(" ... [raised at t.py:3 in f]"), text
    assert "op=SU ..." not in text and len(text) < 320
    assert one_line(KeyError, KeyError("k")) == "KeyError: 'k'"


@pytest.mark.procs
def test_thread_exception_is_recorded(tmp_path: Path) -> None:
    code = "import threading\nt = threading.Thread(target=lambda: 1 / 0, name='loader')\n" \
           "t.start(); t.join()"
    _run(code, tmp_path / "e.json")
    rec = json.loads((tmp_path / "e.json").read_text())
    assert rec["exc_type"] == "ZeroDivisionError" and rec["thread"] == "loader"


@pytest.mark.procs
def test_sigterm_runs_finally_and_exits_143(tmp_path: Path) -> None:
    code = ("import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\nfinally:\n    open(os.environ['MARK'], 'w').write('x')\n")
    res = _procs.run(
        [sys.executable, "-c", HOOKED + code], timeout=30, cwd=None,
        env={**env(), "MARK": str(tmp_path / "mark"), "RANKWISE_ERROR_FILE": str(tmp_path / "e")})
    assert res.returncode == 143 and (tmp_path / "mark").exists()
    assert not (tmp_path / "e").exists()  # a teardown is not an error


@pytest.mark.procs
def test_user_sigterm_handler_is_kept(tmp_path: Path) -> None:
    code = ("import signal, os, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "from rankwise.launch.worker import install_worker_hooks\ninstall_worker_hooks()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n")
    res = _procs.run([sys.executable, "-c", code], timeout=30, env=env(), cwd=None)
    assert res.returncode == 7


def _outcome(rank: int, code: int, at: float, exc: str | None = None, **kw: object) -> WorkerOutcome:
    error = None if exc is None else {"exc_type": exc, "exc_mro": [exc, "Exception"],
                                      "message": "m", "traceback": "TB", "timestamp": at}
    return WorkerOutcome(rank=rank, local_rank=rank, node_rank=0, pid=100 + rank,
                         returncode=code, observed_at=at + 0.5, error=error, **kw)  # type: ignore[arg-type]


def test_root_cause_skips_secondary_failures() -> None:
    outcomes = [
        _outcome(0, 1, 10.0, "PeerFailure"),             # earliest, but a consequence
        _outcome(1, 143, 10.1, signalled_by_launcher=True),
        _outcome(2, 1, 11.0, "ValueError"),              # the real cause
        _outcome(3, -signal.SIGKILL, 12.0),
    ]
    assert root_cause(outcomes) is outcomes[2]
    text = format_summary(outcomes)
    assert text.count("Root cause") == 1 and "rank       : 2 " in text
    assert "rank 3: killed by SIGKILL (signal 9, exit status 137)" in text
    assert root_cause([_outcome(0, 0, 1.0)]) is None


def test_a_frozen_rank_the_others_blame_is_the_root_cause_not_a_victim() -> None:
    """Every failure is secondary (the victims' PeerFailure, the frozen rank killed by the
    teardown): the rank they blame leads, here or, named, on another node."""
    victim = _outcome(2, 1, 10.0, "PeerFailure")
    assert victim.error is not None
    victim.error["peer"] = 3
    frozen = _outcome(3, -signal.SIGKILL, 15.0, signalled_by_launcher=True)
    assert root_cause([victim, frozen]) is frozen
    assert blamed_elsewhere(victim, [victim, frozen]) == ""
    line = blamed_elsewhere(victim, [victim])  # rank 3 lives on another node
    assert line.startswith("rank 3, as rank 2 (node 0) reported it: PeerFailure: m"), line
    assert blamed_elsewhere(_outcome(1, 1, 1.0, "ValueError"), []) == ""
    woke = _outcome(3, 1, 16.0, "PeerFailure", stopped_at=9.0)  # SIGCONT: it blames rank 2
    assert woke.error is not None
    woke.error["peer"] = 2
    assert root_cause([victim, woke]) is woke


@pytest.mark.slow
@pytest.mark.procs
def test_peer_failure_reaches_survivors(tmp_path: Path) -> None:
    try:
        import rankwise

        rankwise.init_process_group  # noqa: B018
        rankwise.all_reduce  # noqa: B018
    except (ImportError, AttributeError):
        pytest.skip("the core (init_process_group, all_reduce) has not landed yet")
    res = run_launcher("-n", "3", "--grace", "5", "--no-prefix",
                       str(SCRIPTS / "collective_fail.py"), str(tmp_path), timeout=60)
    assert res.returncode == 1, res.stderr
    assert "ValueError: rank 1 gives up" in res.stderr
    assert "rank       : 1 " in res.stderr
    for rank in (0, 2):  # told at once (well before the 5 s grace) and ran their finally
        assert (tmp_path / f"peer_failure_{rank}").read_text() == "1"
        assert (tmp_path / f"finally_{rank}").exists()
    assert os.path.exists(tmp_path / "finally_1")
