"""The reading half of ``TcpTransport``: draining a connection into frames, straight into
a posted buffer when the payload is large, through a staging buffer when it is small.
Runs on whichever thread reads (the I/O thread, or a driver: see ``transport.tcp``)."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from .. import settings
from ..errors import DistNetworkError
from ..wire.frames import DROP, HEADER, HOLD, Frame, WireError, decode_header
from .base import FrameHandler

__all__ = ["FrameReader"]

_STAGE = 1 << 18  #: staging buffer per connection for small frames
_DIRECT_MIN = 1 << 15  #: payload remainders at least this big are read straight into place
_LOWAT_MAX = settings.integer("RANKWISE_RCVLOWAT")
#: bytes read from one connection before the I/O thread looks at the others again: a peer
#: streaming a large message must not delay noticing that another peer died
_READ_BUDGET = 8 << 20
_SKIP_CHUNK = 1 << 20  #: dropped payloads are read through a scratch buffer this big


@dataclass(slots=True)
class _Conn:
    rank: int
    sock: socket.socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    #: allocated on the first read (``_STAGE`` bytes): a rank of a big job reads from
    #: O(log N) of its peers, and an eager stage per peer was 64 MiB per rank at 256
    stage: bytearray = field(default_factory=bytearray)
    start: int = 0
    end: int = 0
    frame: Frame | None = None  #: frame whose payload is being read directly
    target: memoryview | None = None
    token: object = None
    got: int = 0
    lowat: int = 1  #: current SO_RCVLOWAT: wake the I/O thread only for this many bytes
    #: the last frame was large, so the next probably is: read its header alone rather
    #: than pull the start of its payload into the stage and copy it out again
    large: bool = False
    closed: bool = False
    broken: BaseException | None = None
    held: bool = False  #: the handler had no room for the next frame: not read for now
    wake: bool = False  #: ``resume`` was called: try the held frame again
    skip: int = 0  #: bytes of a dropped payload still to read after the current target


class FrameReader:
    """Reads frames off connections and hands them to the handler (``TcpTransport``
    provides the attributes annotated here)."""

    _handler: FrameHandler | None
    _closing: bool
    _why: dict[int, BaseException]
    _scratch: memoryview | None

    def _attend(self) -> None:
        raise NotImplementedError

    def _fatal(self, conn: _Conn | None, exc: BaseException) -> bool:
        raise NotImplementedError

    def _last_of(self, conn: _Conn, reason: BaseException | None) -> bool:
        raise NotImplementedError

    def _read(self, conn: _Conn, reparse: bool = False) -> bool:
        """Read what is available on ``conn``; False once the connection has ended.
        ``reparse``: first hand over what the stage holds (a held frame, resumed).

        Runs for every frame received, so the loop keeps its state in locals and calls
        out only to hand over a header or a finished payload.
        """
        assert self._handler is not None
        recv_into = conn.sock.recv_into
        budget = _READ_BUDGET  # then let select() serve the other connections too
        try:
            if reparse:
                self._parse(conn)
            while budget > 0 and not conn.held:
                target = conn.target
                if target is not None:
                    n = recv_into(target[conn.got:])
                    if n == 0:
                        return self._lost(conn, None)
                    got = conn.got = conn.got + n
                    budget -= n
                    remaining = len(target) - got
                    self._set_lowat(conn, remaining + conn.skip)
                    if not remaining:
                        if conn.skip:
                            self._skip_more(conn)
                        else:
                            self._payload_done(conn)
                    continue
                end = conn.end
                if end == _STAGE:
                    self._compact(conn)
                    end = conn.end
                limit = end + HEADER.size if conn.large and conn.start == end else _STAGE
                if not conn.stage:
                    conn.stage = bytearray(_STAGE)
                n = recv_into(memoryview(conn.stage)[end:limit])
                if n == 0:
                    return self._lost(conn, None)
                conn.end = end + n
                budget -= n
                self._parse(conn)
                if n < limit - end:
                    # a short read drained the socket: another recv would only raise
                    # BlockingIOError (a system call and an exception per wake-up, for
                    # each small frame); the level-triggered selector calls again when
                    # more arrives
                    return True
            return True
        except BlockingIOError:
            return True
        except WireError as exc:
            return self._lost(conn, DistNetworkError(
                f"rank {conn.rank} sent bytes that are not a valid rankwise frame ({exc}); "
                "connection dropped"))
        except OSError as exc:
            return self._lost(conn, exc)
        except Exception as exc:  # noqa: BLE001 - never die silently
            return self._fatal(conn, exc)

    def _skip_more(self, conn: _Conn) -> None:
        """Point ``conn`` at the next piece of a payload that is read and dropped."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SKIP_CHUNK))
        piece = min(conn.skip, _SKIP_CHUNK)
        conn.target, conn.got = self._scratch[:piece], 0
        conn.skip -= piece

    @staticmethod
    def _set_lowat(conn: _Conn, remaining: int) -> None:
        """Let epoll wake us only when a good part of a large payload is queued.

        Each wake-up costs the I/O thread a GIL acquisition; with many ranks on few
        cores those hand-offs, not the copying, dominated large messages. The mark never
        exceeds what is still owed, so the last bytes always wake us. (Called for every
        read of a payload: the system call is made only when the mark changes.)
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
        rest of a large payload. (``conn`` is kept current before every hand-over, so a
        handler may read from it again.)"""
        handler = self._handler
        assert handler is not None
        stage = conn.stage
        hsize = HEADER.size
        while conn.target is None:
            start, end = conn.start, conn.end
            if end - start < hsize:
                break
            frame = decode_header(stage, start, conn.rank)
            n = frame.payload_len
            available = end - start - hsize
            if n > available and n - available < _DIRECT_MIN and n <= _STAGE - hsize:
                if start:
                    self._compact(conn)
                return  # small frame still arriving: wait for it in the stage
            header_at = start
            start += hsize
            take = min(n, available)
            conn.start = start + take
            conn.large = n >= _DIRECT_MIN
            target, token = handler.on_header(frame)
            if target is None:
                if token is HOLD:  # no room for it now: read this peer again on resume
                    conn.start = header_at
                    conn.held = True
                    self._attend()
                    return
                assert token is DROP
                if take < n:  # the rest of the payload is read and dropped
                    conn.frame, conn.token, conn.skip = frame, DROP, n - take
                    self._skip_more(conn)
                continue
            view = memoryview(target).cast("B")
            if take:
                view[:take] = memoryview(stage)[start:start + take]
            if take == n:
                handler.on_payload(frame, token)
                continue
            conn.frame, conn.target, conn.token, conn.got = frame, view, token, take
            self._set_lowat(conn, n - take)
        if conn.start == conn.end:
            conn.start = conn.end = 0

    def _payload_done(self, conn: _Conn) -> None:
        assert self._handler is not None and conn.frame is not None
        frame, token = conn.frame, conn.token
        conn.frame, conn.target, conn.token, conn.got = None, None, None, 0
        if token is not DROP:
            self._handler.on_payload(frame, token)

    def _lost(self, conn: _Conn, reason: BaseException | None) -> bool:
        conn.broken = reason or ConnectionResetError("closed by peer")
        self._attend()
        if self._last_of(conn, reason) and not self._closing and self._handler is not None:
            self._handler.on_peer_lost(conn.rank, reason or self._why.get(conn.rank))
        return False
