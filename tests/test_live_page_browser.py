"""The live page as a person sees it: headless Chromium on a real 4-rank deadlocking job.

Skipped where Debian's ``chromium`` (``/usr/bin/chromium``) is not installed, as in CI;
the same page and JSON are checked with urllib in ``test_live_page_job.py`` everywhere.
Chromium's DOM (``--dump-dom``, after the page's script ran) must hold the 4 rows, the
stuck ranks highlighted with their file:line, then the ``DeadlockError`` report, and
``--screenshot`` must write a PNG (``LIVE_PAGE_SCREENSHOT=docs/live.png`` keeps it, and
the one taken before the report as ``docs/live-stuck.png``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _procs import ROOT, run, start

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.procs, pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is not installed (Debian: apt-get install "
                              "chromium); the page is still tested with urllib"),
]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1500,760", "--virtual-time-budget=3000"]


def _chromium(url: str, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="rankwise-chromium-") as profile:
        done = run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
                   timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _job(api: str) -> dict[str, Any]:
    with urllib.request.urlopen(api, timeout=5) as resp:  # noqa: S310 - http:// only
        return dict(json.loads(resp.read()))


def _until(what: str, deadline: float, fn: Any) -> Any:
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)  # a polling interval: fn decides
    raise AssertionError(f"timed out waiting for {what}")


def _rows(dom: str) -> dict[int, tuple[str, str]]:
    """rank -> (the row's class, its text) from Chromium's DOM."""
    return {int(m.group(1)): (m.group(2), re.sub(r"<[^>]+>", " ", m.group(3)))
            for m in re.finditer(r'<tr id="rank-(\d+)" class="([^"]*)">(.*?)</tr>', dom)}


def test_page_in_chromium(tmp_path: Path) -> None:
    env = {**os.environ, "RANKWISE_DEADLOCK_AFTER": "10", "RANKWISE_LIVE_LINGER": "30",
           "STEPS": "20"}
    proc = start([sys.executable, "-m", "rankwise", "run", "-n", "4", "--no-prefix",
                  str(ROOT / "examples" / "live_deadlock.py")], env=env, merge_stderr=True)
    deadline = time.monotonic() + 150
    assert proc.stdout is not None
    url = ""
    while not url:  # the launcher prints it first thing; EOF means it never will
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "no live page line from the launcher"
        m = re.search(r"live page at (http://\S+)", line)
        url = m.group(1) if m else ""
    base, token = url.split("/?token=")
    api = f"{base}/api/job?token={token}"
    _until("the stuck ranks", deadline,
           lambda: all(r.get("stuck") for r in _job(api)["ranks"]) and _job(api)["ranks"])

    rows = _rows(_chromium(url, "--dump-dom"))
    stuck_shot = tmp_path / "live-stuck.png"
    _chromium(url, f"--screenshot={stuck_shot}")
    assert sorted(rows) == [0, 1, 2, 3], rows
    assert rows[0][0] == "stuck" and "live_deadlock.py:36" in rows[0][1], rows[0]
    assert rows[3][0] == "stuck" and "live_deadlock.py:34" in rows[3][1], rows[3]

    _until("the report", deadline, lambda: _job(api)["report"])
    shot = tmp_path / "live.png"
    dom = _chromium(url, "--dump-dom")
    _chromium(url, f"--screenshot={shot}")
    rows = _rows(dom)
    assert all(cls == "failed" for cls, _ in rows.values()), rows
    assert "raised DeadlockError" in rows[0][1] and "live_deadlock.py:36" in rows[0][1]
    report = re.search(r'<div id="report" style="display: block;">(.*?)</div>', dom, re.DOTALL)
    assert report is not None and "DeadlockError: deadlock: all 4 live ranks" in report.group(1)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10000
    keep = os.environ.get("LIVE_PAGE_SCREENSHOT")
    if keep:  # docs/live.png (the report) and docs/live-stuck.png (before it)
        shutil.copy(shot, keep)
        shutil.copy(stuck_shot, keep.replace(".png", "-stuck.png"))
    proc.kill()
