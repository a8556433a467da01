"""The busy-rank stack (issue 15) is read only when someone asks where a rank is.

Ranks as threads (``run_threads``): one waits inside a user function, the other asks
``who_is_where()``; ``sys._current_frames`` is counted to show that collectives never
call it (the fast path reads no stacks), only the answer to a where-query does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.testing.threads import run_threads

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def frame_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How often ``sys._current_frames`` was called while the test ran."""
    calls = [0]
    real = sys._current_frames

    def counting() -> dict[int, Any]:
        calls[0] += 1
        return real()

    monkeypatch.setattr(sys, "_current_frames", counting)
    yield calls


def crunch(release: threading.Event) -> None:
    release.wait(30)  # the user's long step  @crunch


def test_stack_read_only_when_asked(frame_reads: list[int]) -> None:
    release = threading.Event()
    t = np.ones(1, np.float32)

    def body(rank: int, n: int) -> str:
        for _ in range(200):
            dist.all_reduce(t)
            dist.barrier()
        dist.barrier()
        reads_before = frame_reads[0]
        table = ""
        if rank == 1:
            crunch(release)
        else:
            deadline = time.monotonic() + 20
            while "in crunch" not in table and time.monotonic() < deadline:
                table = dist.who_is_where()
            release.set()
        dist.barrier()
        return f"{reads_before}\n{table}"

    zero, _ = run_threads(body, 2)
    reads_before, table = zero.split("\n", 1)
    assert reads_before == "0", "a collective read thread stacks on the fast path"
    assert frame_reads[0] >= 1
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("rank 1:"))
    assert "running user code at test_busy_stack.py:" in line and " in crunch <- " in line, table
    assert "in body" in line and "(release.wait)" in line, table
