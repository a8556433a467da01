"""The launcher's one reaper thread (launch/reaper.py): every worker's stop and exit is
reported, through pidfds and through the polling fallback alike."""

from __future__ import annotations

import os
import queue
import signal
import sys

import _procs
import pytest

from rankwise.launch import reaper as reaper_mod
from rankwise.launch.reaper import Reaper

pytestmark = pytest.mark.procs

Event = tuple[str, int, int, float]


def _next(events: queue.SimpleQueue[Event]) -> Event:
    return events.get(timeout=20.0)  # bounded: a lost report fails, never hangs


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polled"])
def test_stops_and_exits_of_every_worker_are_reported(pidfd: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if not pidfd:
        monkeypatch.delattr(reaper_mod.os, "pidfd_open", raising=False)
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    reaper = Reaper(lambda kind, rank, status, when: events.put((kind, rank, status, when)))
    sleepers = [_procs.start([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(3)]
    quick = _procs.start([sys.executable, "-c", "raise SystemExit(7)"])
    for rank, proc in enumerate([*sleepers, quick]):
        reaper.add(rank, proc.pid)
    kind, rank, status, _ = _next(events)
    assert (kind, rank, os.waitstatus_to_exitcode(status)) == ("exit", 3, 7)

    os.kill(sleepers[1].pid, signal.SIGSTOP)
    kind, rank, status, _ = _next(events)
    assert (kind, rank) == ("stop", 1) and os.WSTOPSIG(status) == signal.SIGSTOP

    for proc in sleepers:
        os.kill(proc.pid, signal.SIGKILL)
    ended = {}
    for _ in sleepers:
        kind, rank, status, _ = _next(events)
        assert kind == "exit", (kind, rank)
        ended[rank] = os.waitstatus_to_exitcode(status)
    assert ended == {0: -signal.SIGKILL, 1: -signal.SIGKILL, 2: -signal.SIGKILL}
