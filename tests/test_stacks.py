"""``identity.stacks.current_frames``: ``sys._current_frames()`` with the garbage collector
off while it runs (CPython gh-106883: a collection inside it that frees a torch tensor
froze a process in CI), and the collector's state as it was afterwards."""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

import pytest

from rankwise.identity import stacks


def test_the_collector_is_off_while_the_frames_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = sys._current_frames

    def recording() -> dict[int, Any]:
        seen.append(gc.isenabled())
        return real()

    monkeypatch.setattr(stacks.sys, "_current_frames", recording)
    assert gc.isenabled()
    frames = stacks.current_frames()
    assert seen == [False]
    assert gc.isenabled()  # on again
    assert frames[threading.get_ident()].f_code.co_name == "recording"  # this thread, now


def test_a_collector_turned_off_by_the_program_stays_off() -> None:
    gc.disable()
    try:
        stacks.current_frames()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failing_read_turns_the_collector_back_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing() -> dict[int, Any]:
        raise MemoryError("no room")

    monkeypatch.setattr(stacks.sys, "_current_frames", failing)
    with pytest.raises(MemoryError):
        stacks.current_frames()
    assert gc.isenabled()
