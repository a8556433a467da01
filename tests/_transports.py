"""Helpers shared by the transport tests: a recording ``FrameHandler`` and a world of
shared-memory transports inside one process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from rankwise.store import HashStore
from rankwise.transport.hello import Hello
from rankwise.transport.links import Links
from rankwise.transport.shm import ShmTransport
from rankwise.transport.tcp import TcpTransport
from rankwise.wire.frames import Frame

WAIT = 10.0  #: a bound on every wait below: a broken transport fails, never hangs


class Recorder:
    """A ``FrameHandler`` that keeps what arrives, for assertions."""

    def __init__(self) -> None:
        self.frames: list[tuple[Frame, bytes]] = []
        self.lost: list[tuple[int, BaseException | None]] = []
        self.cv = threading.Condition()
        #: the answer to give a header instead of a buffer (DROP / HOLD), by tag
        self.answers: dict[int, str] = {}
        self.offered: list[int] = []  #: tags of every header offered, in order

    def on_header(self, frame: Frame) -> tuple[bytearray | None, object]:
        with self.cv:
            self.offered.append(frame.tag)
            answer = self.answers.get(frame.tag)
            self.cv.notify_all()
        if answer is not None:
            return None, answer
        buf = bytearray(frame.payload_len)
        return buf, buf

    def on_payload(self, frame: Frame, token: object) -> None:
        assert isinstance(token, bytearray)
        with self.cv:
            self.frames.append((frame, bytes(token)))
            self.cv.notify_all()

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        with self.cv:
            self.lost.append((rank, reason))
            self.cv.notify_all()

    def on_fatal(self, exc: BaseException) -> None:
        with self.cv:
            self.lost.append((-1, exc))
            self.cv.notify_all()

    def wait_for(self, test: Callable[[], bool]) -> None:
        with self.cv:
            assert self.cv.wait_for(test, WAIT), "timed out waiting for the transport"


def start_all(transports: list[Any], recorders: list[Recorder] | None = None
              ) -> list[Recorder]:
    """Start each transport with its own recorder (new ones unless given)."""
    recs = recorders if recorders is not None else [Recorder() for _ in transports]
    for t, rec in zip(transports, recs):
        t.start(rec)
    return recs


def shm_world(n: int, ring_bytes: int = 1 << 20) -> list[Any]:
    """n ShmTransports of this process, sharing one segment (each rank's rendezvous runs
    on a thread of its own, as the ranks would in their processes)."""
    store = HashStore()
    made: dict[int, ShmTransport] = {}

    def open_one(r: int) -> None:
        made[r] = ShmTransport.open(store, "conformance", r, n, list(range(n)), WAIT,
                                    ring_bytes=ring_bytes)

    threads = [threading.Thread(target=open_one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert sorted(made) == list(range(n)), "shared-memory rendezvous did not finish"
    return [made[r] for r in range(n)]




def lazy_tcp_world(n: int, job: bytes = b"job", token: bytes | None = None
                   ) -> list[TcpTransport]:
    """n TcpTransports of this process that open their connections on demand (each
    listens on loopback; the addresses are handed over as ``Mesh.publish`` would)."""
    listeners = [socket.create_server(("127.0.0.1", 0), backlog=n + 8) for _ in range(n)]
    addrs = {r: f"127.0.0.1:{s.getsockname()[1]}" for r, s in enumerate(listeners)}
    return [TcpTransport(r, n, {}, links=Links(Hello(r, n, job, token), listeners[r], addrs))
            for r in range(n)]


def shm_thread_groups(size: int, **kw: Any) -> list[Any]:
    """Ranks as threads of this process on a HashStore (setup only; collectives that
    need several ranks at once run on threads too)."""
    import threading

    from rankwise.engines.shm import ShmGroup
    from rankwise.store import HashStore

    store = HashStore()
    got: dict[int, Any] = {}

    def make(r: int) -> None:
        got[r] = ShmGroup(store, "t", r, size, timeout=10, slot_bytes=65536, **kw)

    ts = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return [got[r] for r in range(size)]
