"""The launchers' UDP node beats (``launch.beacon``), in-process on loopback: a node that
stops beating is judged lost, one that says it does not hear us too (a one-way partition),
and a stranger can neither forge nor replay a beat; plus the settings and the ranks' end
of the launcher's news pipe (``core.heartbeat``)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from rankwise.core.heartbeat import _news_fd
from rankwise.errors import InvalidArgument
from rankwise.launch import beacon as beacon_mod
from rankwise.launch.beacon import Beacon, node_timeout

TIMEOUT = 0.7  #: beats every 0.1 s


def _until(cond: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # bounded polling of the beacon threads' records
    return True


@pytest.fixture(name="pair")
def _pair() -> Iterator[tuple[Beacon, Beacon]]:
    a, b = Beacon(0, TIMEOUT, "127.0.0.1"), Beacon(1, TIMEOUT, "127.0.0.1")
    a.add_peer(1, b.record().encode())
    b.add_peer(0, a.record().encode())
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def _forge(sender: Beacon, receiver: Beacon, seq: int, age_ms: int, key: bytes) -> None:
    """A beat as ``sender`` would send it, under ``key``, to ``receiver``."""
    head = beacon_mod._HEAD.pack(beacon_mod._MAGIC, sender.node, seq, age_ms)
    info = json.loads(receiver.record())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(head + sender._mac(key, head), (info["host"], info["port"]))


def test_a_node_whose_beats_stop_is_lost_and_not_before(pair: tuple[Beacon, Beacon]) -> None:
    a, b = pair
    assert _until(lambda: a.heard(1) > 0 and b.heard(0) > 0)
    time.sleep(3 * TIMEOUT)  # beating for a while: the span judged, not a synchronization
    assert a.verdict(1, time.monotonic(), TIMEOUT) == ""
    b.stop()
    stopped = time.monotonic()
    assert _until(lambda: a.verdict(1, time.monotonic(), TIMEOUT) != "")
    assert time.monotonic() - stopped < TIMEOUT + 1.0
    assert a.verdict(1, time.monotonic(), TIMEOUT).startswith("stopped answering")
    a.forgive(time.monotonic())  # we were the ones standing still: a fresh window
    assert a.verdict(1, time.monotonic(), TIMEOUT) == ""


def test_a_node_that_no_longer_hears_us_is_lost_one_way(pair: tuple[Beacon, Beacon]) -> None:
    a, b = pair
    assert _until(lambda: a.heard(1) > 0)
    b.stop()  # from now on "b" is us, forging its beats: it hears a, a's beats do not arrive
    for seq in range(10**6, 10**6 + 5):
        _forge(b, a, seq, 5000, b._key)
    assert _until(lambda: "one-way network partition" in a.verdict(1, time.monotonic(),
                                                                    TIMEOUT))


def test_a_forged_or_replayed_beat_changes_nothing(pair: tuple[Beacon, Beacon]) -> None:
    a, b = pair
    assert _until(lambda: a.heard(1) > 0)
    b.stop()
    _forge(b, a, 10**9, 5000, b"\0" * 16)  # a stranger: no key
    _forge(b, a, 1, 5000, b._key)  # an old beat, replayed
    assert _until(lambda: a.verdict(1, time.monotonic(), TIMEOUT) != "")
    assert "one-way" not in a.verdict(1, time.monotonic(), TIMEOUT)  # only the silence


def test_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKWISE_NODE_TIMEOUT", raising=False)
    assert node_timeout(15.0) == 3.5 and node_timeout(0.0) == 0.0
    monkeypatch.setenv("RANKWISE_NODE_TIMEOUT", "2")
    assert node_timeout(0.0) == 2.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("RANKWISE_NODE_TIMEOUT", bad)
        with pytest.raises(InvalidArgument, match="RANKWISE_NODE_TIMEOUT"):
            node_timeout(15.0)


def test_the_news_pipe_is_taken_only_when_it_is_that_very_pipe() -> None:
    r, w = os.pipe()
    try:
        ino = os.fstat(r).st_ino
        assert _news_fd(f"{r}:{ino + 1}") is None  # another pipe now holds that number
        assert _news_fd(f"{w + 1000}:{ino}") is None  # no such fd
        assert _news_fd("junk") is None
        assert _news_fd(f"{r}:{ino}") == r
        assert not os.get_inheritable(r)
    finally:
        os.close(r)
        os.close(w)


def test_a_beat_just_after_a_peer_was_heard_still_goes_out(pair: tuple[Beacon, Beacon]) -> None:
    """The receive thread may note a beat after the send thread read the clock: the age
    it sends is then 0, not negative (which once killed the send thread: a false report)."""
    a, _ = pair
    assert _until(lambda: a.heard(1) > 0)
    seq = a._seq
    a.beat(a.heard(1) - 1.0)  # "now" a second before the peer was heard
    assert a._seq == seq + 1
