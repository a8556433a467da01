"""Connections opened on demand (``transport.links``), in one process over loopback.

What must hold: a rank opens no connection to a peer it never talks to; concurrent
first sends share one dial; a stranger at a rank's listener mid-job is refused without
disturbing anything; a peer whose listener is gone (or that never answers) fails the
send at once with an error naming it; and a peer with two connections is reported lost
once, after everything it sent on either.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _transports import WAIT, Recorder, lazy_tcp_world, start_all

from rankwise.errors import DistNetworkError, DistTimeout, RendezvousError
from rankwise.transport import links
from rankwise.transport.hello import Hello
from rankwise.transport.links import Links
from rankwise.transport.tcp import TcpTransport
from rankwise.wire.frames import Kind, encode_header


@pytest.fixture
def world() -> Iterator[Any]:
    made: list[TcpTransport] = []

    def make(n: int) -> tuple[list[TcpTransport], list[Recorder]]:
        transports = lazy_tcp_world(n)
        made.extend(transports)
        return transports, start_all(transports)

    yield make
    for t in made:
        t.close()


def _send(t: TcpTransport, dst: int, tag: int, payload: bytes = b"x") -> None:
    t.send(dst, encode_header(Kind.P2P, tag=tag, payload_len=len(payload)), payload,
           time.monotonic() + WAIT)


def _got(rec: Recorder, src: int, tag: int) -> None:
    rec.wait_for(lambda: any(f.src == src and f.tag == tag for f, _ in rec.frames))


def test_a_rank_connects_only_to_the_peers_it_talks_to(world: Any) -> None:
    ts, recs = world(4)
    assert all(t.connected() == set() for t in ts)  # nothing at start
    _send(ts[0], 1, 1)
    _got(recs[1], 0, 1)
    _send(ts[1], 0, 2)  # the answer goes back on the connection rank 0 opened
    _got(recs[0], 1, 2)
    assert [t.connected() for t in ts] == [{1}, {0}, set(), set()]
    assert len(ts[0]._conns) == len(ts[1]._conns) == 1


def test_concurrent_first_sends_open_one_connection(world: Any) -> None:
    ts, recs = world(2)
    start = threading.Barrier(8)

    def send(tag: int) -> None:
        start.wait(WAIT)
        _send(ts[0], 1, tag)

    threads = [threading.Thread(target=send, args=(tag,)) for tag in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    recs[1].wait_for(lambda: len(recs[1].frames) == 8)
    assert len(ts[0]._conns) == 1
    assert ts[1].connected() == {0} and len(ts[1]._conns) == 1


def test_strangers_at_a_listener_are_refused_and_the_job_goes_on(world: Any) -> None:
    ts, recs = world(2)
    addr = ts[1]._links._addrs[1]  # type: ignore[union-attr]
    host, _, port = addr.rpartition(":")
    silent = socket.create_connection((host, int(port)))  # says nothing, stays open
    garbage = socket.create_connection((host, int(port)))
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        for hello in (Hello(0, 2, b"another job", None), Hello(1, 2, b"job", None),
                      Hello(0, 3, b"job", None)):  # other job, rank 1 itself, other size
            with pytest.raises(RendezvousError, match="refused rank"):
                Links(hello, listener, {1: addr}).dial(1, time.monotonic() + WAIT)
        _send(ts[0], 1, 7)  # the honest peer is not held up behind the silent one
        _got(recs[1], 0, 7)
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):
            silent.recv(1)  # still waiting for its handshake: it delayed nobody
        assert ts[1].connected() == {0} and not recs[1].lost and not recs[0].lost
    finally:
        for s in (silent, garbage, listener):
            s.close()


def test_a_peer_whose_listener_is_gone_fails_the_send_at_once_naming_it(world: Any) -> None:
    ts, recs = world(3)
    ts[2].close()  # before anyone connected to it
    for _ in range(2):  # the second attempt fails the same way, without dialing again
        with pytest.raises(DistNetworkError, match="could not connect to rank 2 at .*"
                           "no longer listens"):
            _send(ts[0], 2, 1)
    _send(ts[0], 1, 2)  # the others are unaffected
    _got(recs[1], 0, 2)


def test_a_peer_that_never_answers_the_handshake_fails_within_its_bound(
        world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links, "HANDSHAKE_TIMEOUT", 0.2)
    mute = socket.create_server(("127.0.0.1", 0))  # a hung process: accepts, never answers
    try:
        hello = Hello(0, 2, b"job", None)
        dialer = Links(hello, socket.create_server(("127.0.0.1", 0)),
                       {1: f"127.0.0.1:{mute.getsockname()[1]}"})
        try:
            with pytest.raises(DistNetworkError, match="rank 1"):
                dialer.dial(1, time.monotonic() + WAIT)
        finally:
            dialer.close()
    finally:
        mute.close()


class _Ordered(Recorder):
    """Notes how many frames had arrived when each loss was reported."""

    def __init__(self) -> None:
        super().__init__()
        self.frames_at_loss: list[int] = []

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        self.frames_at_loss.append(len(self.frames))
        super().on_peer_lost(rank, reason)


def test_a_peer_with_two_connections_is_lost_once_after_all_it_sent() -> None:
    ts = lazy_tcp_world(2)
    recs: list[_Ordered] = [_Ordered(), _Ordered()]
    try:
        start_all(ts, list(recs))
        _send(ts[0], 1, 4)  # rank 0 dials rank 1 ...
        _got(recs[1], 0, 4)
        # ... and rank 1 dials rank 0 too (as when both ends dial at once)
        dialed = ts[1]._links.dial(0, time.monotonic() + WAIT)  # type: ignore[union-attr]
        ts[1]._send[0] = ts[1]._adopt(0, dialed)
        _send(ts[1], 0, 5)
        _got(recs[0], 1, 5)
        assert len(ts[0]._conns) == len(ts[1]._conns) == 2
        _send(ts[1], 0, 6, b"last words" * 1000)  # on the connection rank 1 opened ...
        ts[1].close()  # ... then both close at once
        recs[0].wait_for(lambda: bool(recs[0].lost))
        assert [rank for rank, _ in recs[0].lost] == [1] and not ts[0].connected()
        assert recs[0].frames_at_loss == [2] and recs[0].frames[-1][0].tag == 6
    finally:
        for t in ts:
            t.close()


class _HeldLinks(Links):
    """Links whose dials wait for the test's go before they start."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.go = threading.Event()
        self.dials = 0

    def dial(self, peer: int, deadline: float) -> socket.socket:
        self.dials += 1
        self.go.wait(WAIT)  # a bound, not a synchronisation: released by the test
        return super().dial(peer, deadline)


def test_a_send_whose_deadline_passes_mid_dial_times_out_and_the_dial_goes_on() -> None:
    ts = lazy_tcp_world(2)
    links = ts[0]._links
    assert links is not None
    held = _HeldLinks(links._hello, links._listener, links._addrs)
    ts[0]._links = held
    try:
        recs = start_all(ts)
        with pytest.raises(DistTimeout, match="could not connect to rank 1"):
            ts[0].send(1, encode_header(Kind.P2P, tag=1, payload_len=1), b"x",
                       time.monotonic() + 0.1)
        assert held.dialing(1)  # still under way, in the background
        held.go.set()
        _send(ts[0], 1, 2)  # waits for the same dial, then sends on it
        _got(recs[1], 0, 2)
        assert held.dials == 1 and len(ts[0]._conns) == 1
        assert [f.tag for f, _ in recs[1].frames] == [2]
    finally:
        held.go.set()
        links.close()  # (the listener's accept thread; held shares its listener)
        for t in ts:
            t.close()
