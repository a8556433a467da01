"""Issue 48's acceptance, in real ``rankwise run`` jobs of DDP (``launch_scripts/
ddp_stragglers.py``): a rank whose ``Dataset.__getitem__`` sleeps 30 ms a batch is named
on the live page within 10 s of training starting and in the summary's ``straggler:``
line; with no sleep nobody is named; with the NaN check on, a NaN rank 1 writes into a
gradient at step 5 makes every rank raise at step 5, before any data moved."""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest
from _procs import ROOT, run, start

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = ROOT / "tests" / "launch_scripts" / "ddp_stragglers.py"


def _line_of(marker: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - http:// only
        return json.loads(resp.read())


class _Job:
    """A ``rankwise run`` of the script, its merged output read line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = start([sys.executable, "-m", "rankwise", "run", "-n", "4", "--no-prefix",
                           str(SCRIPT), *args], merge_stderr=True)
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), ""))

    def until(self, pattern: str, deadline: float) -> tuple[float, re.Match[str]]:
        while time.monotonic() < deadline:
            try:
                at, line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return at, m
            if line == "":
                break
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.seen)[-4000:]}")

    def rest(self, deadline: float) -> str:
        self.proc.wait(max(1.0, deadline - time.monotonic()))
        while True:
            try:
                line = self.lines.get(timeout=5)[1]
            except queue.Empty:
                break
            if line == "":
                break
            self.seen.append(line)
        return "".join(self.seen)


def _watch_page(job: _Job, deadline: float, want: int | None) -> tuple[float, list[Any]]:
    """Poll the page until it names ``want`` (None: to the end of the job); what it
    named, and when (monotonic)."""
    _, m = job.until(r"live page at (http://\S+)", deadline)
    base, token = m.group(1).split("/?token=")
    started, _ = job.until(r"training starts", deadline)
    named: list[Any] = []
    while time.monotonic() < deadline and job.proc.poll() is None:
        try:
            found = _get(f"{base}/api/job?token={token}")["stragglers"]
        except OSError:
            break  # the job ended and the page with it
        named.extend(found)
        if want is not None and any(s["rank"] == want for s in found):
            return time.monotonic() - started, named
        time.sleep(0.1)  # a polling interval; the page decides
    return time.monotonic() - started, named


def test_a_sleeping_rank_is_named_on_the_page_and_in_the_summary() -> None:
    deadline = time.monotonic() + 240
    job = _Job("--sleep-rank", "2", "--sleep-ms", "30", "--steps", "400")
    after, named = _watch_page(job, deadline, want=2)
    assert named and named[-1]["rank"] == 2, named
    assert after < 10.0, f"named {after:.1f} s after training started"
    out = job.rest(deadline)
    (line,) = [x for x in out.splitlines() if x.startswith("straggler:")]
    m = re.match(r"straggler: rank 2 holds the others back ([\d.]+) ms per step", line)
    assert m, line
    assert 15.0 < float(m.group(1)) < 120.0, line  # 30 ms a batch; a loaded machine stretches
    assert f"ddp_stragglers.py:{_line_of('# the straggler')} in __getitem__" in line, line
    assert "calling time.sleep" in line
    print(f"page named rank 2 {after:.1f} s after training started; {line}")


@pytest.mark.parametrize("run_no", range(3))
def test_balanced_ranks_name_nobody(run_no: int) -> None:
    deadline = time.monotonic() + 240
    job = _Job("--steps", "250")
    _, named = _watch_page(job, deadline, want=None)
    out = job.rest(deadline)
    assert "finished 250 steps" in out, out[-3000:]
    assert named == [] and "straggler:" not in out, (named, out[-3000:])


@pytest.mark.parametrize("ddp", ["rankwise", "torch"])
def test_a_nan_in_one_gradient_raises_on_every_rank_before_it_is_reduced(ddp: str) -> None:
    done = run([sys.executable, "-m", "rankwise", "run", "-n", "3", "--no-prefix",
                "--nan-check", str(SCRIPT), "--ddp", ddp, "--nan-rank", "1", "--nan-step",
                "5", "--steps", "10"], timeout=240, merge_stderr=True)
    raised = [x for x in done.stdout.splitlines() if x.startswith("RAISED")]
    ranks = sorted(int(m.group(1)) for x in raised if (m := re.search(r"rank=(\d)", x)))
    assert ranks == [0, 1, 2], done.stdout[-4000:]
    backward = f"ddp_stragglers.py:{_line_of('# the backward line')} in main"
    for x in raised:
        assert "step=5 " in x and "params_same=True" in x, x
        assert "NonFiniteInput: non-finite input to all_reduce" in x, x
        assert f"at {backward}" in x, x
        assert "rank 1's input holds" in x and "in the gradient of fc1.weight, at step 5" in x
        if "rank=1 " not in x:  # nothing reached the other ranks' gradients
            assert "grads_finite=True" in x, x
