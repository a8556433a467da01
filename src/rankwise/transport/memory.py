"""An in-process transport: N ranks as threads, frames handed over through queues.

Why: the router, the fingerprint checks and every algorithm can then be tested in
milliseconds, without sockets or processes, and the transport conformance suite has a
second implementation to keep the ``Transport`` contract honest (httpx tests its client
over a mock transport the same way). Frames go through the same header decoder as TCP,
so hostile-byte handling is shared, and payloads are copied at ``send`` so a sender may
reuse its buffer at once, as with a socket.

>>> transports = MemoryHub(2).transports  # one per rank; start() each with a handler
"""

from __future__ import annotations

import threading
from collections import deque

from ..errors import DistError, DistNetworkError
from ..wire.frames import DROP, HEADER, HOLD, WireError, decode_header
from .base import FrameHandler, NoDriving

__all__ = ["MemoryHub", "MemoryTransport"]

#: (source rank, header bytes, payload bytes) as queued for a receiver
_Item = tuple[int, bytes, bytes]


class MemoryHub:
    """The "network" of one in-process job: a transport per rank, all wired together."""

    def __init__(self, world_size: int) -> None:
        self.transports = [MemoryTransport(self, r, world_size) for r in range(world_size)]

    def deliver(self, src: int, dst: int, header: bytes, payload: bytes) -> None:
        self.transports[dst].enqueue((src, header, payload))

    def left(self, rank: int, reason: BaseException | None) -> None:
        """``rank`` closed (reason None) or died: every other rank loses its connection."""
        for t in self.transports:
            if t.rank != rank:
                t.peer_lost(rank, reason)


class MemoryTransport(NoDriving):
    """One rank's end: a queue of arriving frames per sender and a thread that delivers
    them (a held sender's frames wait, in order, until ``resume``)."""

    def __init__(self, hub: MemoryHub, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._hub = hub
        #: per sender, in arrival order: frames, then a loss marker (header None)
        self._queues: dict[int, deque[_Item | tuple[int, None, BaseException | None]]] = {}
        self._held: set[int] = set()  #: senders whose head frame the handler held
        self._cv = threading.Condition()
        self._handler: FrameHandler | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._gone: set[int] = set()

    # --- Transport ------------------------------------------------------------------------

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        if self._closed:
            raise DistNetworkError(f"rank {self.rank}'s transport is closed")
        if dst in self._gone or self._hub.transports[dst].closed:
            raise DistNetworkError(f"rank {dst} is gone (connection closed)")
        if len(header) != HEADER.size:
            raise ValueError(f"a header is {HEADER.size} bytes, got {len(header)}")
        self._hub.deliver(self.rank, dst, bytes(header), bytes(payload) if payload else b"")

    def start(self, handler: FrameHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=f"rankwise-mem-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def resume(self, rank: int) -> None:
        with self._cv:
            self._held.discard(rank)
            self._cv.notify()

    def close(self) -> None:
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._hub.left(self.rank, None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # --- the hub's side -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def kill(self) -> None:
        """Fault injection: this rank vanishes without a goodbye (as SIGKILL would)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._hub.left(self.rank, ConnectionResetError("peer killed"))

    def enqueue(self, item: _Item) -> None:
        with self._cv:
            self._queues.setdefault(item[0], deque()).append(item)
            self._cv.notify()

    def peer_lost(self, rank: int, reason: BaseException | None) -> None:
        with self._cv:  # after the frames it sent before
            self._queues.setdefault(rank, deque()).append((rank, None, reason))
            self._cv.notify()

    def _next(self) -> tuple[int, bytes | None, bytes | BaseException | None] | None:
        """The head item of a sender that is not held (None once closed)."""
        with self._cv:
            while not self._closed:
                for src, q in self._queues.items():
                    if q and src not in self._held:
                        return q[0]
                self._cv.wait()
            return None

    def _pop(self, src: int) -> None:
        with self._cv:
            self._queues[src].popleft()

    def _run(self) -> None:
        handler = self._handler
        assert handler is not None
        try:
            while (item := self._next()) is not None:
                self._deliver(handler, *item)
        except Exception as exc:  # noqa: BLE001 - the reader must never die silently
            handler.on_fatal(DistError(f"rank {self.rank}'s in-memory reader failed: {exc!r}"))

    def _deliver(self, handler: FrameHandler, src: int, header: bytes | None,
                 rest: bytes | BaseException | None) -> None:
        if header is None:
            self._pop(src)
            self._gone.add(src)
            handler.on_peer_lost(src, rest if isinstance(rest, BaseException) else None)
            return
        assert isinstance(rest, bytes)
        if src in self._gone:
            self._pop(src)
            return  # its connection was dropped: nothing more is read from it
        try:
            frame = decode_header(header, 0, src)
            if frame.payload_len != len(rest):
                raise WireError(f"a frame claiming {frame.payload_len} payload bytes came "
                                f"with {len(rest)}")
        except WireError as exc:  # as TCP does: drop that peer, keep serving the rest
            self._pop(src)
            self._gone.add(src)
            handler.on_peer_lost(src, DistNetworkError(
                f"rank {src} sent bytes that are not a valid rankwise frame ({exc}); "
                "connection dropped"))
            return
        target, token = handler.on_header(frame)
        if token is HOLD:  # no room now: this sender waits, others go on
            with self._cv:
                self._held.add(src)
            return
        self._pop(src)
        if token is DROP:
            return
        assert target is not None
        if frame.payload_len:
            memoryview(target).cast("B")[:frame.payload_len] = rest
        handler.on_payload(frame, token)
