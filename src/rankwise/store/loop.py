"""The store server's event loop: every client served by one thread, whatever their number.

Why: one thread per client (the design before) costs a thread stack and a wake-up per
client on every write; at thousands of ranks the server spends its time waking threads
that go back to sleep, and its client cap (4,096) stops a job from starting. torch's
TCPStore moved to a libuv loop for the same reason. Here one ``selectors`` loop reads,
decodes (``protocol.parse_request``, same bounds as the blocking reader), answers, and
parks blocked ``get``/``wait`` requests as *waiters registered per key*: a write wakes
only the waiters of the key it wrote, and a wait for N keys costs O(1) per arriving key.

Timers (handshake, half-sent frame, waiter deadline) live in one heap; each connection
has at most one armed timer, stale heap entries are skipped by sequence number.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import AuthError, DistError
from ..transport.keepalive import keep_alive
from ..wire.auth import ForeignClient, ServerHandshake
from .protocol import (
    Limits,
    Op,
    ProtocolError,
    Request,
    Status,
    decode_int,
    encode_response,
    parse_request,
)

__all__ = ["Dispatch", "StoreLoop", "Waiting"]

log = logging.getLogger(__name__)

_RECV = 256 * 1024
_OUT_HIGH = 4 * 1024 * 1024  #: stop reading a client whose replies pile up past this


@dataclass
class Waiting:
    """A ``get``/``wait`` the table cannot answer yet: the keys still missing."""

    keys: list[bytes]
    missing: set[bytes]
    timeout_s: float


#: runs one request: a reply (status, fields), or ``Waiting`` when it must block
Dispatch = Callable[[Request], "tuple[Status, list[bytes]] | Waiting"]


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    hs: ServerHandshake | None
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    waiting: Waiting | None = None
    request: Request | None = None  #: the request ``waiting`` belongs to
    closing: bool = False  #: close once ``outbuf`` is flushed
    timer: int = 0  #: sequence number of the armed timer (0: none)
    events: int = selectors.EVENT_READ


class StoreLoop:
    """Serves ``listener`` on the calling thread until ``stop()``; see the module doc."""

    def __init__(self, listener: socket.socket, token: bytes | None, purpose: str,
                 limits: Limits, handshake_timeout: float, frame_timeout: float,
                 max_connections: int, dispatch: Dispatch,
                 present: Callable[[list[bytes]], list[bytes]],
                 on_auth_failure: Callable[[str, AuthError], None],
                 on_foreign: Callable[[bytes, socket.socket], bool],
                 keepalive_s: float = 0.0) -> None:
        self._listener = listener
        self._token = token
        self._purpose = purpose
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._frame_timeout = frame_timeout
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s  #: the heartbeat timeout (0: no keepalive)
        self._dispatch = dispatch
        self._missing_of = present  #: which of these keys are not in the table now
        self._on_auth_failure = on_auth_failure
        self._on_foreign = on_foreign
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}
        self._waiters: dict[bytes, set[_Conn]] = {}
        self._timers: list[tuple[float, int, _Conn]] = []
        self._seq = itertools.count(1)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._accepting = True

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Ask the loop (from any thread) to answer its waiters ``CLOSED`` and return."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def run(self) -> None:
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._next_timeout()):
                    obj = key.fileobj
                    if obj is self._listener:
                        self._accept()
                    elif obj is not self._wake_r:
                        assert isinstance(obj, socket.socket)
                        conn = self._conns.get(obj)
                        if conn is not None:
                            self._ready(conn, mask)
                self._fire_timers()
            self._shutdown()
        finally:
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _shutdown(self) -> None:
        closed = encode_response(Status.CLOSED, [b"the store server is shutting down"])
        for conn in list(self._conns.values()):
            if conn.waiting is not None:
                try:  # best effort: a waiter learns why at once rather than by a hang-up
                    conn.sock.send(bytes(conn.outbuf) + closed)
                except OSError:
                    pass
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(conn)

    # ------------------------------------------------------------ connections
    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("store: out of file descriptors with %d clients; accepting "
                                "again when one leaves", len(self._conns))
                    self._sel.unregister(self._listener)
                    self._accepting = False
                return
            peer = f"{addr[0]}:{addr[1]}"
            if len(self._conns) >= self._max_connections:
                log.debug("store: refusing %s (%d connections)", peer, len(self._conns))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(sock, self._keepalive_s)  # a vanished client is dropped in the end
            conn = _Conn(sock, peer, ServerHandshake(self._token, self._purpose, peer))
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)
            self._arm(conn, self._handshake_timeout)

    def _drop(self, conn: _Conn) -> None:
        if self._detach(conn):
            conn.sock.close()

    def _detach(self, conn: _Conn) -> bool:
        """Forget ``conn`` without closing its socket; False if it was forgotten already."""
        if self._conns.pop(conn.sock, None) is None:
            return False
        self._unwait(conn)
        conn.timer = 0
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if not self._accepting and not self._stopping:
            self._sel.register(self._listener, selectors.EVENT_READ)
            self._accepting = True
        return True

    def _ready(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and conn.sock in self._conns:
                data = conn.sock.recv(_RECV)
                if not data:
                    raise ConnectionError("the client hung up")
                conn.inbuf += data
                if conn.waiting is not None and len(conn.inbuf) > _OUT_HIGH:
                    raise ProtocolError(f"{conn.peer} kept sending while its request waits")
                self._process(conn)
        except ForeignClient as exc:
            # every byte it sent so far: a listener that takes the connection replays them
            if self._on_foreign(exc.head + bytes(conn.inbuf), conn.sock):
                self._detach(conn)  # served elsewhere now (torch's store: launch.torch_store)
                return
            self._on_auth_failure(conn.peer, exc)
            self._drop(conn)
        except AuthError as exc:
            self._on_auth_failure(conn.peer, exc)
            self._drop(conn)
        except (DistError, OSError) as exc:  # malformed frames and hang-ups end this client
            log.debug("store: dropping %s: %s", conn.peer, exc)
            self._drop(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle every complete handshake step or request buffered for ``conn``."""
        while conn.waiting is None and not conn.closing and conn.sock in self._conns:
            hs = conn.hs
            if hs is not None:
                if len(conn.inbuf) < hs.need:
                    break
                data = bytes(conn.inbuf[: hs.need])
                del conn.inbuf[: hs.need]
                self._send(conn, hs.step(data))
                if hs.error is not None:
                    self._on_auth_failure(conn.peer, hs.error)
                    conn.closing = True  # after the client was told why
                elif hs.done:
                    conn.hs = None
                    conn.timer = 0  # idle clients may stay quiet for the whole job
                continue
            parsed = parse_request(conn.inbuf, self._limits, conn.peer)
            if parsed is None:
                if conn.inbuf and not conn.timer:  # a frame began: it must end in time
                    self._arm(conn, self._frame_timeout)
                break
            request, used = parsed
            del conn.inbuf[:used]
            conn.timer = 0
            self._answer(conn, request, self._dispatch(request))
        self._update(conn)
        if conn.closing and not conn.outbuf:
            self._drop(conn)

    def _answer(self, conn: _Conn, request: Request,
                result: tuple[Status, list[bytes]] | Waiting) -> None:
        if isinstance(result, Waiting):
            conn.waiting, conn.request = result, request
            for key in result.missing:
                self._waiters.setdefault(key, set()).add(conn)
            self._arm(conn, result.timeout_s)
            return
        status, fields = result
        self._send(conn, encode_response(status, fields))
        if status is Status.CLOSED:
            conn.closing = True

    # ------------------------------------------------------------ waiters
    def written(self, key: bytes) -> None:
        """``key`` was written: wake the waiters of that key only (loop thread only)."""
        conns = self._waiters.pop(key, None)
        if not conns:
            return
        for conn in conns:
            waiting = conn.waiting
            if waiting is None:
                continue
            waiting.missing.discard(key)
            if waiting.missing:
                continue
            still = self._missing_of(waiting.keys)  # a key may have been deleted since
            if still:
                waiting.missing.update(still)
                for k in still:
                    self._waiters.setdefault(k, set()).add(conn)
                continue
            request = conn.request
            assert request is not None
            self._unwait(conn)
            conn.timer = 0
            self._answer(conn, request, self._dispatch(_nonblocking(request)))
            self._process(conn)  # anything it sent meanwhile

    def _unwait(self, conn: _Conn) -> None:
        waiting, conn.waiting, conn.request = conn.waiting, None, None
        if waiting is None:
            return
        for key in waiting.missing:
            group = self._waiters.get(key)
            if group is not None:
                group.discard(conn)
                if not group:
                    del self._waiters[key]

    # ------------------------------------------------------------ timers
    def _arm(self, conn: _Conn, seconds: float) -> None:
        conn.timer = next(self._seq)
        heapq.heappush(self._timers, (time.monotonic() + seconds, conn.timer, conn))

    def _next_timeout(self) -> float | None:
        while self._timers and self._timers[0][2].timer != self._timers[0][1]:
            heapq.heappop(self._timers)  # disarmed or replaced
        if not self._timers:
            return None
        return max(self._timers[0][0] - time.monotonic(), 0.0)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, seq, conn = heapq.heappop(self._timers)
            if conn.timer != seq or conn.sock not in self._conns:
                continue
            conn.timer = 0
            if conn.waiting is None:  # a handshake or a half-sent frame that stalled
                log.debug("store: dropping %s: it stalled mid-handshake or mid-frame",
                          conn.peer)
                self._drop(conn)
                continue
            missing = sorted(conn.waiting.missing)
            request = conn.request
            self._unwait(conn)
            keys = missing if request is None or request.op is Op.WAIT else [missing[0]]
            self._send(conn, encode_response(Status.TIMEOUT, keys))
            self._process(conn)

    # ------------------------------------------------------------ output
    def _send(self, conn: _Conn, data: bytes) -> None:
        if data:
            conn.outbuf += data
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                sent = 0
            del conn.outbuf[:sent]
        self._update(conn)
        if conn.closing and not conn.outbuf:
            self._drop(conn)

    def _update(self, conn: _Conn) -> None:
        """Write while replies are queued; read unless they pile up (or it is closing)."""
        if conn.sock not in self._conns:
            return
        events = selectors.EVENT_WRITE if conn.outbuf else 0
        if len(conn.outbuf) < _OUT_HIGH and not conn.closing:
            events |= selectors.EVENT_READ
        if events and events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events)


def _nonblocking(request: Request) -> Request:
    """``request`` with its timeout set to zero: asked again once its keys exist."""
    f = request.fields
    if request.op is Op.GET:
        return Request(Op.GET, (f[0], _ZERO))
    if request.op is Op.WAIT:
        return Request(Op.WAIT, (_ZERO, *f[1:]))
    return request


_ZERO = (0).to_bytes(8, "big", signed=True)
assert decode_int(_ZERO) == 0
