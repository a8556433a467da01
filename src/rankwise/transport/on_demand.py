"""The on-demand half of ``TcpTransport``: opening, adopting and choosing connections.

Why its own piece: with connections opened when first needed (``links``), which
connection a frame goes out on and when a peer counts as lost are decisions of their own:
each direction keeps the one connection it first sent on (the one we dialed, or the one
the peer opened to us), so frames stay in order; every connection is read; a peer is lost
only once all of its connections ended. Over a full mesh (no ``links``) each peer has
exactly one connection and all of this reduces to the mesh's behaviour.
"""

from __future__ import annotations

import socket
import threading
import time

from .. import settings
from ..errors import DistError, DistNetworkError, DistTimeout
from .base import FrameHandler
from .keepalive import keep_alive
from .links import Links
from .mesh import HANDSHAKE_TIMEOUT
from .tcp_reading import _Conn

__all__ = ["OnDemand", "tuned"]

_SOCK_BUF = 4 << 20  #: per direction and connection; RANKWISE_SOCKBUF overrides


class OnDemand:
    """Connection bookkeeping (``TcpTransport`` provides the attributes annotated here)."""

    rank: int
    world_size: int
    _conns: tuple[_Conn, ...]
    _send: dict[int, _Conn]
    _links: Links | None
    _adding: threading.Lock
    _why: dict[int, BaseException]
    _closing: bool
    _handler: FrameHandler | None
    _grown: list[bool]

    def _attend(self) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def open_to(self, dst: int, deadline: float) -> None:
        """Open the connection to ``dst`` now rather than at the first send to it."""
        self._connect(dst, deadline)

    def _connect(self, dst: int, deadline: float) -> _Conn:
        """The connection to send to ``dst`` on, opened now: the one ``dst`` opened to us
        if any, else one we dial (concurrent first sends wait for the same dial)."""
        links = self._links
        if links is None or not 0 <= dst < self.world_size or dst == self.rank:
            raise DistNetworkError(f"rank {self.rank} has no connection to rank {dst}")
        with self._adding:
            conn = self._send.get(dst)
            if conn is None and not links.dialing(dst):
                conn = next((c for c in self._conns if c.rank == dst and c.broken is None),
                            None)
                if conn is not None:
                    self._send[dst] = conn
        return conn or links.connect(dst, deadline, self._adopt_to_send)

    def _adopt_to_send(self, peer: int, sock: socket.socket) -> _Conn:
        """A dialed connection: ours to send on, unless the peer's came first and a
        sender chose that one meanwhile (then this one is only read)."""
        conn = self._adopt(peer, sock)
        with self._adding:
            return self._send.setdefault(peer, conn)

    def _adopt(self, peer: int, sock: socket.socket) -> _Conn:
        """Add a proven connection to ``peer`` (dialed, or from the accept thread); the
        reader picks it up at its next look."""
        conn = _Conn(peer, tuned(sock))
        with self._adding:
            if self._closing:
                sock.close()
                raise DistNetworkError(f"rank {self.rank} is closing its connections")
            self._conns = (*self._conns, conn)
        self._grown[0] = self._grown[1] = True
        self._attend()
        self._wake()
        return conn

    def audience(self) -> list[int]:
        """The peers a frame meant for every rank goes to: every one over a full mesh;
        else the peers we have a connection with and our ring neighbours, who pass a
        failure on in turn (``passes_on``), never one connection per pair of ranks."""
        if self._links is None:
            return [p for p in range(self.world_size) if p != self.rank]
        near = self.connected() | {(self.rank + 1) % self.world_size,
                                   (self.rank - 1) % self.world_size}
        return sorted(near - {self.rank})

    def connected(self) -> set[int]:
        """The peers this rank has a live connection with."""
        return {c.rank for c in self._conns if c.broken is None and not c.closed}

    def passes_on(self) -> bool:
        """Whether a rank that learns of a failure must tell its own ``audience``."""
        return self._links is not None

    def _last_of(self, conn: _Conn, reason: BaseException | None) -> bool:
        """``conn`` ended: is it the last of its peer's (then report the peer lost)? Its
        other connections end too when it goes, after what they still carry (a goodbye
        on one must not lose the race with the close of another)."""
        if isinstance(reason, DistError):
            return True  # it broke the protocol (garbage bytes): lost now, whatever else
        with self._adding:
            if reason is not None:
                self._why.setdefault(conn.rank, reason)
            return conn.rank not in self.connected()

    def watch(self, peer: int) -> None:
        """This rank waits on ``peer`` with no connection to it: open one (in the
        background), so that its end is heard here; a peer that is gone already (its
        listener refuses) is reported lost at once."""
        links = self._links
        if links is None or not 0 <= peer < self.world_size or peer == self.rank \
                or peer in self.connected() or links.dialing(peer):
            return
        threading.Thread(target=self._watch_dial, args=(peer,), daemon=True,
                         name="rankwise-watch").start()

    def _watch_dial(self, peer: int) -> None:
        try:
            self._connect(peer, time.monotonic() + HANDSHAKE_TIMEOUT)
        except DistTimeout:
            return  # hung, not gone: the heartbeats and the wait's own timeout tell
        except DistError as exc:
            handler = self._handler
            if not self._closing and handler is not None and peer not in self.connected():
                handler.on_peer_lost(peer, exc)


def tuned(sock: socket.socket) -> socket.socket:
    """Non-blocking, no Nagle delay, kernel keepalives, big buffers: set when the
    connection is opened, so a rank pays buffers only for the peers it talks to."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)  # a vanished host's connection errors out in the end
    bufsize = settings.integer("RANKWISE_SOCKBUF", _SOCK_BUF)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:  # fewer wake-ups per MiB moved; the kernel caps it at its maximum
            sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
        except OSError:
            pass
    return sock
