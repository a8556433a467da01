"""The fault matrix: every kind of rank failure, at every kind of place, under the launcher.

faults {raise, exit 0, os._exit(3), SIGKILL, SIGSTOP, early destroy_process_group}
x places {before init, all_reduce, p2p recv, rank_zero_first block, DDP backward}
x {2, 4} ranks, each run as `python -m rankwise run -n N tests/launch_scripts/fault_worker.py`.

Every case asserts the promise: each survivor raises the class the fault calls for
(``RendezvousError`` before init, ``PeerFailure`` after it, ``DistTimeout`` with the
who-is-where report for a stopped rank) within a bound far below the timeout (a stopped
rank: at the timeout), the launcher exits non-zero, and no process of the job is left
(every process carries a marker in its environment, checked in /proc/*/environ).

By default a fixed representative subset runs (each fault and each place at least once)
plus one more case that rotates with the date; ``RANKWISE_FULL_MATRIX=1`` runs all 60.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import _procs
import pytest
from launch_scripts.helpers import ROOT, SCRIPTS, env, launcher_cmd, marked_processes

pytestmark = pytest.mark.procs

FAULT = str(SCRIPTS / "fault_worker.py")
KINDS = ["raise", "exit0", "exit3", "sigkill", "sigstop", "destroy"]
PLACES = ["init", "all_reduce", "recv", "rzf", "ddp"]
SIZES = [2, 4]

STOP_TIMEOUT = 6.0  #: the group timeout when a rank is stopped: survivors raise at it
LONG_TIMEOUT = 60.0  #: the group timeout otherwise: survivors must raise long before it
PROMPT = 15.0  #: "at once" on a loaded 2-core machine (a Python start-up is ~1 s there)
REPORT_SLACK = 12.0  #: gathering the who-is-where report after the timeout, under load

DEFAULT = {
    ("raise", "all_reduce", 2),
    ("exit0", "init", 2),
    ("exit3", "recv", 4),
    ("sigkill", "rzf", 2),
    ("sigstop", "rzf", 2),
    ("destroy", "recv", 2),
    ("sigkill", "ddp", 2),
    ("sigstop", "all_reduce", 4),
}
ALL = [(k, p, n) for n in SIZES for p in PLACES for k in KINDS]
_rest = [c for c in ALL if c not in DEFAULT]
ROTATING = _rest[datetime.date.today().toordinal() % len(_rest)]
FULL = os.environ.get("RANKWISE_FULL_MATRIX") == "1"


def _fault_rank(place: str, n: int) -> int:
    """Who misbehaves: rank 0 where the place makes it special (rank_zero_first's
    leader), else one that is neither first nor always the last."""
    return {"init": n - 1, "all_reduce": 1, "recv": 1, "rzf": 0, "ddp": n - 1}[place]


def _expected(kind: str, place: str) -> str:
    if place == "init":
        return "RendezvousError"
    return "DistTimeout" if kind == "sigstop" else "PeerFailure"


def _params() -> list[Any]:
    out = []
    for case in ALL:
        marks = []
        if case not in DEFAULT and case != ROTATING:
            marks = [pytest.mark.slow,
                     pytest.mark.skipif(not FULL, reason="full matrix: RANKWISE_FULL_MATRIX=1")]
        if case[1] == "ddp":
            marks.append(pytest.mark.torch)
        out.append(pytest.param(*case, id="-".join(map(str, case)), marks=marks))
    return out


def _leftovers(marker: str, within: float) -> list[int]:
    deadline = time.monotonic() + within
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        threading.Event().wait(0.1)  # bounded re-check of /proc, not a synchronisation
        left = marked_processes(marker)
    return left


@pytest.mark.parametrize(("kind", "place", "n"), _params())
def test_fault(tmp_path: Path, kind: str, place: str, n: int) -> None:
    if place == "ddp":
        pytest.importorskip("torch")
    stopped = kind == "sigstop"
    timeout = STOP_TIMEOUT if stopped else LONG_TIMEOUT
    bad = _fault_rank(place, n)
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    e = env()
    e.update(FAULT_RANK=str(bad), FAULT_KIND=kind, FAULT_PLACE=place, FAULT_TIMEOUT=str(timeout),
             FAULT_OUT=str(tmp_path), FAULT_MARKER=marker)
    start = time.monotonic()
    try:
        res = _procs.run(launcher_cmd("-n", str(n), "--grace", "3", "--no-prefix", FAULT),
                         env=e, timeout=120, cwd=ROOT)
    finally:
        left = _leftovers(marker, 5.0)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    took = time.monotonic() - start
    log = f"\n--- launcher stderr ---\n{res.stderr[-6000:]}"
    assert res.returncode != 0, "the launcher exited 0" + log
    assert not left, f"processes of the job outlived the launcher: {left}" + log
    want = _expected(kind, place)
    for r in range(n):
        if r == bad:
            continue
        path = tmp_path / f"result_{r}.json"
        assert path.exists(), f"survivor rank {r} recorded nothing" + log
        got: dict[str, Any] = json.loads(path.read_text())
        what = f"rank {r}: {got.get('type')}: {got.get('message', '')[:1500]}" + log
        assert got["ok"] is False, f"rank {r} finished as if nothing happened" + log
        assert want in got["mro"], f"expected {want}; " + what
        elapsed = float(got["elapsed"])
        if stopped:
            assert timeout - 1.0 <= elapsed <= timeout + REPORT_SLACK, f"{elapsed:.1f}s; " + what
            if place != "init":
                assert got["report"], "no who-is-where report; " + what
        else:
            assert elapsed <= PROMPT, f"took {elapsed:.1f}s, timeout {timeout:g}s; " + what
        if want == "PeerFailure" or (place == "init" and not stopped):
            assert f"rank {bad}" in got["message"], "the failed rank is not named; " + what
    assert took < 90.0, f"the case took {took:.0f}s"
