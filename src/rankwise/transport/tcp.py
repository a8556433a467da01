"""Frames over a full mesh of TCP connections, read by one background I/O thread.

Why this shape (see DESIGN.md, "Progress engine"): receives must progress while the
user's thread computes or is blocked in a send, so a single daemon thread per process
watches every peer socket with a selector and drains what arrives — straight into the
receiver's posted buffer when one is waiting, which costs no extra copy for large
payloads. Because every receiver always drains, senders can write from the calling
thread without a hand-off and without deadlock. Small frames are read many at a time
through a staging buffer, so a 4-byte all_reduce costs few system calls.

Sockets are non-blocking; a send that would block waits in ``poll`` for at most the
caller's deadline, in slices, so a failure elsewhere interrupts it.
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from .._wire import HEADER, Frame, WireError, decode_header
from ..errors import DistNetworkError, DistTimeout
from .base import FrameHandler

__all__ = ["TcpTransport"]

_STAGE = 1 << 18  #: staging buffer per connection for small frames
_DIRECT_MIN = 1 << 15  #: payload remainders at least this big are read straight into place
_SOCK_BUF = 4 << 20
_LOWAT_MAX = int(os.environ.get("RANKWISE_RCVLOWAT", str(256 << 10)))
_SEND_SLICE = 0.25
#: bytes read from one connection before the I/O thread looks at the others again: a peer
#: streaming a large message must not delay noticing that another peer died
_READ_BUDGET = 8 << 20  #: seconds between failure checks while a send waits for room


@dataclass(slots=True)
class _Conn:
    rank: int
    sock: socket.socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    stage: bytearray = field(default_factory=lambda: bytearray(_STAGE))
    start: int = 0
    end: int = 0
    frame: Frame | None = None  #: frame whose payload is being read directly
    target: memoryview | None = None
    token: object = None
    got: int = 0
    lowat: int = 1  #: current SO_RCVLOWAT: wake the I/O thread only for this many bytes
    closed: bool = False
    broken: BaseException | None = None


class TcpTransport:
    """Owns the connected sockets of one rank and its I/O thread."""

    def __init__(self, rank: int, world_size: int, socks: dict[int, socket.socket]) -> None:
        self.rank = rank
        self.world_size = world_size
        self._conns: dict[int, _Conn] = {}
        for peer, sock in socks.items():
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:  # fewer wake-ups per MiB moved; the kernel caps it at its maximum
                    sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
                except OSError:
                    pass
            self._conns[peer] = _Conn(peer, sock)
        self._handler: FrameHandler | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._thread: threading.Thread | None = None

    # --- sending (caller threads) ------------------------------------------------------

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        conn = self._conns.get(dst)
        if conn is None:
            raise DistNetworkError(f"rank {self.rank} has no connection to rank {dst}")
        parts: list[memoryview] = [memoryview(header)]
        if payload is not None and len(payload):
            parts.append(memoryview(payload).cast("B"))
        with conn.send_lock:
            self._send_parts(conn, parts, deadline)

    def _send_parts(self, conn: _Conn, parts: list[memoryview], deadline: float) -> None:
        sock = conn.sock
        while parts:
            if conn.broken is not None or conn.closed:
                raise DistNetworkError(
                    f"connection from rank {self.rank} to rank {conn.rank} is closed"
                ) from conn.broken
            try:
                sent = sock.sendmsg(parts)
            except BlockingIOError:
                self._wait_writable(conn, deadline)
                continue
            except OSError as exc:
                conn.broken = exc
                raise DistNetworkError(
                    f"sending from rank {self.rank} to rank {conn.rank} failed: {exc}"
                ) from exc
            while sent:
                n = len(parts[0])
                if sent >= n:
                    sent -= n
                    parts.pop(0)
                else:
                    parts[0] = parts[0][sent:]
                    sent = 0

    def _wait_writable(self, conn: _Conn, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistTimeout(
                f"rank {self.rank} could not send to rank {conn.rank} before the timeout: "
                f"rank {conn.rank} is not reading (hung or stopped?)"
            )
        poller = select.poll()
        poller.register(conn.sock, select.POLLOUT)
        poller.poll(min(remaining, _SEND_SLICE) * 1000)

    # --- receiving (the I/O thread) ----------------------------------------------------

    def start(self, handler: FrameHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=f"rankwise-io-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for conn in self._conns.values():
            sel.register(conn.sock, selectors.EVENT_READ, conn)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing and sel.get_map():
                for key, _ in sel.select():
                    conn = key.data
                    if conn is None:
                        self._drain_wake()
                        continue
                    if not self._read(conn):
                        sel.unregister(conn.sock)
        finally:
            sel.close()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _read(self, conn: _Conn) -> bool:
        """Read what is available on ``conn``; False once the connection has ended."""
        assert self._handler is not None
        budget = _READ_BUDGET  # then let select() serve the other connections too
        try:
            while budget > 0:
                if conn.target is not None:
                    n = conn.sock.recv_into(conn.target[conn.got:])
                    if n == 0:
                        return self._lost(conn, None)
                    conn.got += n
                    budget -= n
                    if conn.got == len(conn.target):
                        self._set_lowat(conn, 1)
                        self._payload_done(conn)
                    else:
                        self._set_lowat(conn, len(conn.target) - conn.got)
                    continue
                if conn.end == len(conn.stage):
                    self._compact(conn)
                n = conn.sock.recv_into(memoryview(conn.stage)[conn.end:])
                if n == 0:
                    return self._lost(conn, None)
                conn.end += n
                budget -= n
                self._parse(conn)
            return True
        except BlockingIOError:
            return True
        except WireError as exc:
            return self._lost(conn, DistNetworkError(
                f"rank {conn.rank} sent bytes that are not a valid rankwise frame ({exc}); "
                "connection dropped"))
        except OSError as exc:
            return self._lost(conn, exc)

    def _set_lowat(self, conn: _Conn, remaining: int) -> None:
        """Let epoll wake us only when a good part of a large payload is queued.

        Each wake-up costs the I/O thread a GIL acquisition; with many ranks on few
        cores those hand-offs, not the copying, dominated large messages. The mark never
        exceeds what is still owed, so the last bytes always wake us.
        """
        want = 1 if remaining < _DIRECT_MIN else min(remaining, _LOWAT_MAX)
        if want != conn.lowat:
            try:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                conn.lowat = want
            except OSError:
                pass

    def _compact(self, conn: _Conn) -> None:
        pending = conn.end - conn.start
        conn.stage[:pending] = conn.stage[conn.start:conn.end]
        conn.start, conn.end = 0, pending

    def _parse(self, conn: _Conn) -> None:
        """Consume whole frames from the staging buffer; switch to direct reads for the
        rest of a large payload."""
        assert self._handler is not None
        stage = memoryview(conn.stage)
        hsize = HEADER.size
        while conn.end - conn.start >= hsize and conn.target is None:
            frame = decode_header(stage[conn.start:conn.start + hsize])
            frame.src = conn.rank
            n = frame.payload_len
            available = conn.end - conn.start - hsize
            if n > available and n - available < _DIRECT_MIN and n <= _STAGE - hsize:
                if conn.start:
                    self._compact(conn)
                return  # small frame still arriving: wait for it in the stage
            conn.start += hsize
            target, token = self._handler.on_header(frame)
            view = memoryview(target).cast("B")
            take = min(n, available)
            if take:
                view[:take] = stage[conn.start:conn.start + take]
                conn.start += take
            if take == n:
                self._handler.on_payload(frame, token)
            else:
                conn.frame, conn.target, conn.token, conn.got = frame, view, token, take
                self._set_lowat(conn, n - take)
        if conn.start == conn.end:
            conn.start = conn.end = 0

    def _payload_done(self, conn: _Conn) -> None:
        assert self._handler is not None and conn.frame is not None
        frame, token = conn.frame, conn.token
        conn.frame, conn.target, conn.token, conn.got = None, None, None, 0
        self._handler.on_payload(frame, token)

    def _lost(self, conn: _Conn, reason: BaseException | None) -> bool:
        conn.broken = reason or ConnectionResetError("closed by peer")
        if not self._closing and self._handler is not None:
            self._handler.on_peer_lost(conn.rank, reason)
        return False

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for conn in self._conns.values():
            conn.closed = True
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
