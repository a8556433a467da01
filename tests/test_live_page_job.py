"""The live page of a real ``rankwise run -n 4`` job that deadlocks (issue 38 acceptance).

``examples/live_deadlock.py``: 20 steps of all_reduce, then rank 3 skips a sub-group's
barrier. Polled with urllib under bounded deadlines (no sleep as synchronization): every
rank's row within 2 s of its init, the stuck ranks with their file:line within 3 s of
the deadlock, a stuck rank's stacks on request, then the ``DeadlockError`` report.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from _procs import ROOT, start

pytestmark = [pytest.mark.procs, pytest.mark.slow]

EXAMPLE = str(ROOT / "examples" / "live_deadlock.py")


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - http:// only
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _until(what: str, deadline: float, fn: Any) -> Any:
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)  # a polling interval, not synchronization: fn decides
    raise AssertionError(f"timed out waiting for {what}")


def _lines(proc: Any) -> queue.Queue[tuple[float, str]]:
    out: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            out.put((time.time(), line))

    threading.Thread(target=read, daemon=True).start()
    return out


def test_deadlocking_job_on_the_page() -> None:
    env = {**os.environ, "RANKWISE_DEADLOCK_AFTER": "4", "RANKWISE_LIVE_LINGER": "8",
           "STEPS": "20"}
    proc = start([sys.executable, "-m", "rankwise", "run", "-n", "4", "--no-prefix",
                  EXAMPLE], env=env, merge_stderr=True)
    lines = _lines(proc)
    seen: list[str] = []
    deadline = time.monotonic() + 90

    printed: list[float] = []

    def url_line() -> str | None:
        while not lines.empty():
            at, line = lines.get()
            seen.append(line)
            m = re.search(r"live page at (http://\S+)", line)
            if m:
                printed.append(at)
                return m.group(1)
        return None

    url = _until("the launcher's live page line", deadline, url_line)
    base, token = url.split("/?token=")
    api = f"{base}/api/job?token={token}"
    assert _get(f"{base}/api/job")[0] == 401 and _get(f"{base}/api/job?token=x")[0] == 403

    def rows_seen() -> dict[int, float] | None:
        code, data = _get(api)
        if code == 200 and data["world_size"] == 4 and all(r["seen"] for r in data["ranks"]):
            now = time.time()
            return {r["rank"]: now - r["began"] for r in data["ranks"]}
        return None

    lag = _until("every rank's row", deadline, rows_seen)
    all_rows = time.time() - printed[0]
    assert max(lag.values()) < 2.0, lag  # each row on the page within 2 s of its init

    def stuck_rows() -> tuple[float, list[dict[str, Any]]] | None:
        code, data = _get(api)
        rows = data["ranks"] if code == 200 else []
        if rows and all(r.get("stuck") and re.search(r"live_deadlock\.py:3\d", r["state"])
                        for r in rows):
            return time.time(), rows
        return None

    shown_at, rows = _until("the stuck ranks", deadline, stuck_rows)
    stuck_at = []
    while not lines.empty():
        seen.append(lines.get()[1])
    for line in seen:
        m = re.search(r"rank \d: STUCK ([\d.]+)", line)
        if m:
            stuck_at.append(float(m.group(1)))
    assert len(stuck_at) == 4, seen
    assert shown_at - max(stuck_at) < 3.0, (shown_at, stuck_at)
    assert "barrier() #1" in rows[0]["state"] and "live_deadlock.py:36" in rows[0]["state"]
    assert "all_reduce(float32 x 1024, op=SUM) #21" in rows[3]["state"]
    assert "live_deadlock.py:34" in rows[3]["state"]
    assert rows[0]["calls_per_s"] >= 0 and rows[0]["recent"][0]["seq"] == 20

    code, stacks = _get(f"{base}/api/stacks?rank=0&token={token}")
    assert code == 200 and "live_deadlock.py" in stacks["stacks"], stacks

    def report() -> dict[str, Any] | None:
        code, data = _get(api)
        return data["report"] if code == 200 and data["report"] else None

    rep = _until("the DeadlockError report", deadline, report)
    print(f"rows {max(lag.values()):.2f} s after init ({all_rows:.2f} s after the address "
          f"was printed); stuck shown "
          f"{shown_at - max(stuck_at):.2f} s after the last rank blocked; report "
          f"{time.time() - max(stuck_at):.2f} s after it")
    assert rep["text"].startswith("DeadlockError: deadlock: all 4 live ranks"), rep
    assert "Wait-for cycle" in rep["text"]
    proc.kill()  # the launcher lingers to keep the page up: no need to wait for it


def test_two_nodes_one_page() -> None:
    """Two launchers form a 2x2 job: node 0 serves one page with all 4 ranks (node 1's
    ranks publish to node 0's store); node 1 serves none."""
    from _procs import free_port

    port = str(free_port())
    env = {**os.environ, "STEPS": "400", "RANKWISE_TOKEN": "two-node-secret"}
    common = ["-n", "2", "--nnodes", "2", "--master-port", port, "--rdzv-id", "live",
              "--no-prefix", "--grace", "0.5"]
    nodes = [start([sys.executable, "-m", "rankwise", "run", *common, *extra, EXAMPLE],
                   env=env, merge_stderr=True)
             for extra in ([], ["--node-rank", "1"])]
    lines = _lines(nodes[0])
    deadline = time.monotonic() + 90

    def url_line() -> str | None:
        while not lines.empty():
            m = re.search(r"live page at (http://\S+)", lines.get()[1])
            if m:
                return m.group(1)
        return None

    base = _until("node 0's live page line", deadline, url_line).split("/?token=")[0]
    api = f"{base}/api/job?token=two-node-secret"  # the job's token works too

    def all_four() -> list[dict[str, Any]] | None:
        code, data = _get(api)
        rows = data["ranks"] if code == 200 else []
        return rows if len(rows) == 4 and all(r["seen"] and r["calls"] for r in rows) else None

    rows = _until("4 rows, 2 per node", deadline, all_four)
    assert len({r["pid"] for r in rows}) == 4
    for proc in nodes:
        proc.kill()
    out, _ = nodes[1].communicate(timeout=30)
    assert "live page at" not in out
