"""Heartbeats and the launchers' node watch, in-process (thread ranks, fake clocks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import rankwise as dist
from rankwise.api.world import current
from rankwise.core.heartbeat import DEFAULT_TIMEOUT, heartbeat_timeout
from rankwise.launch.nodewatch import NodeWatch, describe_node
from rankwise.store import HashStore
from rankwise.testing.threads import run_threads
from rankwise.transport.keepalive import keep_alive


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKWISE_HEARTBEAT_TIMEOUT", raising=False)
    assert heartbeat_timeout() == DEFAULT_TIMEOUT
    monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", "0")
    assert heartbeat_timeout() == 0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", bad)
        with pytest.raises(dist.InvalidArgument, match="RANKWISE_HEARTBEAT_TIMEOUT"):
            heartbeat_timeout()
        with pytest.raises(dist.InvalidArgument, match="RANKWISE_HEARTBEAT_TIMEOUT"):
            dist.init_process_group(init_method="tcp://127.0.0.1:1", rank=0, world_size=2)


def test_silent_rank_fails_the_waits_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stays alive but stops beating (as if frozen): rank 0, its watcher, raises a
    PeerFailure naming it, and passes it on to rank 2, which waits on rank 0."""
    monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", "0.4")
    released = threading.Event()

    def body(rank: int, n: int) -> str:
        comm = current().comm
        if rank == 1:
            assert comm.heartbeat is not None
            comm.heartbeat.stop()
            assert released.wait(10)
            return ""
        try:
            dist.recv(np.zeros(1), src=1 if rank == 0 else 0)
        except dist.PeerFailure as exc:
            return str(exc)
        finally:
            if rank == 2:
                released.set()
        return "no failure"

    zero, _, two = run_threads(body, 3, timeout=20)
    assert "rank 1 on host" in zero and "stopped answering" in zero, zero
    assert "network partition, host down or frozen process" in zero
    assert "rank 1" in two and "stopped answering" in two, two


def test_busy_but_beating_rank_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", "0.4")

    def body(rank: int, n: int) -> float:
        if rank == 1:
            x, end = 0, time.monotonic() + 1.5  # 4 timeouts of pure Python
            while time.monotonic() < end:
                x += 1
        buf = np.array([1.0])
        dist.all_reduce(buf)
        return float(buf[0])

    assert run_threads(body, 2, timeout=20) == [2.0, 2.0]


def test_node_watch_names_the_silent_node() -> None:
    store = HashStore()
    watch = NodeWatch(lambda: store, 0, ["h0", "h1", "h2"], 2, timeout=5.0)
    now = watch.store_ok_at
    assert watch.verdict(now + 1) == ""
    watch._heard[2] = now + 4  # node 2 beat later; node 1 never did
    text = watch.verdict(now + 6)
    assert text.startswith("node 1 (h1, ranks 2-3) stopped answering 6.0 s ago"), text
    watch._ended.add(1)  # a node that finished is never reported
    assert watch.verdict(now + 6) == ""
    assert describe_node(3, "x", 1) == "node 3 (x, rank 3)"


def test_node_watch_off_node_zero_names_the_store_host() -> None:
    store = HashStore()
    watch = NodeWatch(lambda: store, 1, ["h0", "h1"], 2, timeout=5.0)
    watch._heard[0] = watch.store_ok_at + 100
    text = watch.verdict(watch.store_ok_at + 7)
    assert text.startswith("node 0 (h0, ranks 0-1) stopped answering 7.0 s ago"), text
    assert "cannot reach the job's store" in text and watch.store_lost


def test_sockets_get_keepalive_and_user_timeout() -> None:
    a, b = socket.socket(), socket.socket()  # TCP
    with a, b:
        keep_alive(a, 6.0)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12000
            assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
        keep_alive(b, 0)  # heartbeats off: left as it is
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0



class _Clock:
    """``time.monotonic`` and the watcher's stop event in one: each wait moves time on,
    by ``freeze`` more seconds at wait ``freeze_at`` (the process stood still), calls
    ``after`` (a beat read), and ends the loop after ``steps`` waits."""

    def __init__(self, steps: int, freeze_at: int, freeze: float) -> None:
        self.now, self.waits = 100.0, 0
        self.steps, self.freeze_at, self.freeze = steps, freeze_at, freeze
        self.after: Callable[[], None] = lambda: None

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits += 1
        self.now += seconds + (self.freeze if self.waits == self.freeze_at else 0.0)
        self.after()
        return self.waits > self.steps

    def is_set(self) -> bool:
        return False


class _Router:
    failure = None

    @staticmethod
    def peer_gone(peer: int) -> bool:
        return False


class _Comm:
    rank, world_size, closed = 1, 2, False
    router = _Router()
    departures = type("Departures", (), {"bye": frozenset()})()


@pytest.mark.parametrize("beats_after", [True, False])
def test_a_watcher_that_stood_still_does_not_blame_its_predecessor(
        monkeypatch: pytest.MonkeyPatch, beats_after: bool) -> None:
    """A rank frozen for 5 s (SIGSTOP) wakes to a 5 s old beat: the silence was its own, so
    it starts the window afresh; a predecessor still silent after that is reported one
    timeout later."""
    from rankwise.core import heartbeat as hb

    clock = _Clock(steps=12, freeze_at=3, freeze=5.0)
    monkeypatch.setattr(hb.time, "monotonic", clock.monotonic)
    beat = hb.Heartbeat(_Comm(), timeout=1.0)  # type: ignore[arg-type]
    beat._stop = clock  # type: ignore[assignment]
    reported: list[float] = []
    beat._report = reported.append  # type: ignore[method-assign]
    beat.heard = clock.now

    def hear() -> None:  # the beats that waited in the socket, read after the freeze
        if clock.waits > clock.freeze_at:
            beat.heard = clock.now
    if beats_after:
        clock.after = hear
    beat._watch_loop()
    if beats_after:
        assert reported == []
    else:
        assert len(reported) == 1 and 1.0 < reported[0] < 1.5, reported
