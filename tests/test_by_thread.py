"""``rankwise.by_thread.ByThread``: per-thread values in a dict, as a thread-local keeps
them (each thread sees its own, a value goes when its thread sets None, a forked child
keeps only the forking thread's), for the hot paths that ask on every call."""

from __future__ import annotations

import os
import select
import signal
import threading

import pytest

from rankwise import by_thread
from rankwise.by_thread import ByThread


def _in_thread(table: ByThread[str], value: str, out: dict[str, object]) -> None:
    def run() -> None:
        out["before"] = table.mine()
        table.set_mine(value)
        out["own"] = table.mine()

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()


def test_each_thread_sees_its_own_value_and_none_takes_it_away() -> None:
    table: ByThread[str] = ByThread()
    assert table.mine() is None and not table, "empty: one truth test answers"
    table.set_mine("main")
    seen: dict[str, object] = {}
    _in_thread(table, "other", seen)
    assert seen == {"before": None, "own": "other"}
    assert table.mine() == "main" and len(table) == 2
    table.set_mine(None)
    assert table.mine() is None and len(table) == 1
    table.set_mine(None)  # twice: nothing to take
    assert len(table) == 1


def test_a_fork_keeps_only_the_forking_threads_value() -> None:
    table: ByThread[str] = ByThread()
    table.set_mine("main")
    _in_thread(table, "other", {})
    by_thread._keep_the_forking_threads()  # what the child runs after os.fork
    assert dict(table) == {threading.get_ident(): "main"}
    table.clear()
    _in_thread(table, "other", {})
    by_thread._keep_the_forking_threads()
    assert not table, "the forking thread had none: none is left"


@pytest.mark.procs
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.fork and os.pidfd_open here")
def test_a_forked_child_runs_the_trim() -> None:
    table: ByThread[str] = ByThread()
    table.set_mine("main")
    _in_thread(table, "other", {})
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the other thread's value is gone
        os._exit(0 if dict(table) == {threading.get_ident(): "main"} else 1)
    fd = os.pidfd_open(pid)  # readable once the child has exited
    try:
        exited, _, _ = select.select([fd], [], [], 30)
    finally:
        os.close(fd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not exit within 30 s")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
