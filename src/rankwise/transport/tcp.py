"""Frames over TCP connections, read by one background I/O thread (or by a caller blocked
in a large collective, ``drive_begin``). Sends go out from the calling thread, waiting in
``poll`` in slices up to the caller's deadline. Rationale and measurements: docs/design.md,
"Progress engine".

The connections are a full mesh made at init (``Mesh.connect``), or opened on demand
(``links``): then a send to a peer with no connection yet dials it (one attempt shared
by concurrent senders), or reuses the connection the peer opened to us. Each direction
keeps the one connection it first sent on, so frames stay in order; every connection is
read, and a peer is reported lost only once all of its connections have ended (its
goodbye may travel on another one than the first to close).
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import selectors
import socket
import termios
import threading
import time

from ..errors import DistError, DistNetworkError, DistTimeout
from ..wire.frames import HEADER, WireError, decode_header
from .base import FrameHandler
from .links import Links
from .on_demand import OnDemand, tuned
from .tcp_reading import FrameReader, _Conn

__all__ = ["TcpTransport"]

_SEND_SLICE = 0.25  #: seconds between failure checks while a send waits for room
_HANDOVER_WAIT = 1.0  #: seconds a caller waits for the I/O thread to park before giving up
_READ_EVENTS = select.POLLIN | select.POLLERR | select.POLLHUP | select.POLLNVAL
#: seconds between checks that the peer of a held connection is still there
_HELD_CHECK = 0.5
_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class TcpTransport(OnDemand, FrameReader):
    """Owns the connected sockets of one rank and its I/O thread."""

    def __init__(self, rank: int, world_size: int, socks: dict[int, socket.socket],
                 links: Links | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        #: the same on every rank of a tcp job: some host runs more ranks than CPUs
        self.crowded = False
        #: every connection, read by the reader; replaced (never changed) when one is added
        self._conns: tuple[_Conn, ...] = tuple(_Conn(peer, tuned(sock))
                                               for peer, sock in socks.items())
        self._send: dict[int, _Conn] = {conn.rank: conn for conn in self._conns}
        self._links = links
        self._adding = threading.Lock()
        self._why: dict[int, BaseException] = {}  #: first reason one of a peer's ended
        self._handler: FrameHandler | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._thread: threading.Thread | None = None
        #: progress hand-over: a caller thread blocked in a large collective reads the
        #: sockets itself while the I/O thread is parked (see ``drive_begin``)
        self._cv = threading.Condition()
        self._driver: int | None = None
        self._io_busy = False
        self._poller: select.poll | None = None
        self._polled: dict[int, _Conn] = {}
        self._scratch: memoryview | None = None
        #: per reader (0: the I/O thread, 1: a driver): a connection was held, resumed or
        #: ended since that reader last looked, so the hot path skips the scan otherwise
        self._attention = [False, False]
        self._grown = [False, False]  #: per reader: a connection was added since it looked
        self._held_any = False
        if links is not None:
            links.start(self._adopt)

    # --- sending (caller threads) ------------------------------------------------------

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        conn = self._send.get(dst)
        if conn is None:
            conn = self._connect(dst, deadline)
        lock = conn.send_lock
        if not lock.acquire(blocking=False):
            self._acquire_send_lock(conn, deadline)
        try:
            body = memoryview(payload if payload is not None else b"").cast("B")
            sent = 0
            if conn.broken is None and not conn.closed:
                try:  # the common case: the socket takes the whole frame at once
                    sent = conn.sock.sendmsg((header, body) if len(body) else (header,))
                except OSError:  # would block, or broken: _send_parts waits or reports
                    sent = 0
                if sent == len(header) + len(body):
                    return
            hsize = len(header)
            rest = [memoryview(header)[sent:], body] if sent < hsize else [body[sent - hsize:]]
            self._send_parts(conn, [part for part in rest if len(part)], deadline)
        finally:
            lock.release()

    def _acquire_send_lock(self, conn: _Conn, deadline: float) -> None:
        """Another thread is sending to the same peer: wait for it, until ``deadline``.
        A driver keeps reading meanwhile: that sender may wait for room that the peer
        makes only once it gets our data."""
        driving = self._driver == threading.get_ident()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistTimeout(f"rank {self.rank} could not send to rank {conn.rank} "
                                  "before the timeout: another send to it never finished")
            if not driving:
                if conn.send_lock.acquire(timeout=remaining):
                    return
            elif conn.send_lock.acquire(blocking=False):
                return
            else:
                self._progress(min(remaining, 0.001), None)

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
                self._attend()
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
                f"rank {conn.rank} is not reading (hung or stopped?), or it does not receive "
                f"what rank {self.rank} sends and its room for unreceived messages is full "
                "(RANKWISE_PARKED_PER_PEER / RANKWISE_PARKED_TOTAL): post the matching "
                f"recv on rank {conn.rank}"
            )
        if self._driver == threading.get_ident():
            self._progress(min(remaining, _SEND_SLICE), conn)
            return
        poller = select.poll()
        poller.register(conn.sock, select.POLLOUT)
        poller.poll(min(remaining, _SEND_SLICE) * 1000)

    # --- progress hand-over (caller threads) ---------------------------------------------

    def drive_begin(self) -> bool:
        """Make the calling thread the reader of every socket until ``drive_end``.

        Why: for large messages with more ranks than cores, each frame handed from the
        I/O thread to the waiting thread costs a wake-up and a GIL hand-off in both
        processes; a thread that reads for itself while it waits pays neither. False
        (and nothing changes) when another thread already drives.
        """
        with self._cv:
            if self._driver is not None or self._closing:
                return False
            self._driver = threading.get_ident()
            if self._io_busy:
                try:
                    os.write(self._wake_w, b"d")
                except OSError:
                    pass
                if not self._cv.wait_for(lambda: not self._io_busy, _HANDOVER_WAIT):
                    self._driver = None  # the I/O thread is slow to let go: keep it
                    return False
        return True

    def drive_end(self) -> None:
        with self._cv:
            if self._driver == threading.get_ident():
                self._driver = None
                self._cv.notify_all()

    def driving(self) -> bool:
        return self._driver == threading.get_ident()

    def progress(self, timeout: float) -> None:
        """Driver only: wait up to ``timeout`` for data and read what arrived."""
        self._progress(timeout, None)

    def _progress(self, timeout: float, writable: _Conn | None) -> None:
        """Poll every live connection (and ``writable`` for room), read what arrived."""
        poller, polled = self._poller, self._polled
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)  # a connection was added
            for conn in self._conns:
                if conn.broken is None and not conn.closed and not conn.held:
                    poller.register(conn.sock, select.POLLIN)
                    polled[conn.sock.fileno()] = conn
        if self._resumed(1):
            for conn in self._conns:
                fd = conn.sock.fileno() if not conn.closed else -1
                want = conn.broken is None and not conn.closed and not conn.held
                if want and fd not in polled:
                    poller.register(fd, select.POLLIN)
                    polled[fd] = conn
                elif not want and fd in polled:
                    poller.unregister(fd)
                    del polled[fd]
        out = writable.sock if writable is not None and \
            writable.sock.fileno() in polled else None
        if out is not None:
            poller.modify(out, select.POLLIN | select.POLLOUT)
        try:
            events = poller.poll(timeout * 1000)
        finally:
            if out is not None:
                poller.modify(out, select.POLLIN)
        for fd, ev in events:
            if fd == self._wake_r:
                self._drain_wake()
                continue
            ready = polled.get(fd)
            if ready is None or not ev & _READ_EVENTS:
                continue
            if ready.broken is not None or ready.closed or not self._read(ready) \
                    or ready.held:
                poller.unregister(fd)
                del polled[fd]

    def resume(self, rank: int) -> None:
        """The handler has room again (or a receive for the held frame): read ``rank``'s
        connection again, starting with the frame it held. Any thread."""
        conns = [c for c in self._conns if c.rank == rank]
        if not conns:
            return
        for conn in conns:
            conn.wake = True
        self._attend()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"r")
        except OSError:
            pass

    def _attend(self) -> None:
        self._attention[0] = self._attention[1] = True

    def _resumed(self, reader: int) -> bool:
        """Reader only: retry the held frames of resumed connections; True when the set
        of connections to read may have changed."""
        if not self._attention[reader]:
            return False
        self._attention[reader] = False  # first: a resume racing with the scan sets it again
        changed = self._grown[reader]
        self._grown[reader] = False
        for conn in self._conns:
            if conn.wake:
                conn.wake = False
                if conn.held and conn.broken is None and not conn.closed:
                    conn.held = False
                    self._read(conn, reparse=True)
                    changed = True
            elif conn.held or conn.broken is not None:
                changed = True
                if conn.held and conn.broken is None and not conn.closed:
                    self._check_held(conn)
        self._held_any = any(c.held for c in self._conns)
        if self._held_any:
            self._attention[reader] = True  # keep checking that held peers are there
        return changed

    def _check_held(self, conn: _Conn) -> None:
        """A held connection is not read, so its end would go unnoticed: if the peer
        hung up before sending all of the held frame, the frame can never complete and
        the peer is lost (a frame that is all there waits for its receive)."""
        poller = select.poll()
        poller.register(conn.sock, select.POLLRDHUP)
        if not any(ev & _HUNG_UP for _, ev in poller.poll(0)):
            return
        size: int | str = "?"
        try:
            size = decode_header(conn.stage, conn.start, conn.rank).payload_len
            queued = array.array("i", [0])
            fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, queued)
            missing = HEADER.size + size - (conn.end - conn.start) - queued[0]
        except (OSError, WireError):
            missing = 1
        if missing > 0:
            conn.held = False
            self._lost(conn, ConnectionResetError(
                f"rank {conn.rank} hung up before the end of a frame of {size} bytes that "
                "was waiting for room or for its receive"))

    # --- receiving (the I/O thread) ----------------------------------------------------

    def start(self, handler: FrameHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._run, name=f"rankwise-io-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for conn in self._conns:
            sel.register(conn.sock, selectors.EVENT_READ, conn)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing and sel.get_map():
                with self._cv:
                    while self._driver is not None and not self._closing:
                        self._cv.wait()
                    self._io_busy = True
                try:
                    if self._resumed(0):  # (or a driver saw one end, or one is held)
                        registered = sel.get_map()
                        for conn in self._conns:
                            want = conn.broken is None and not conn.closed and not conn.held
                            if want and conn.sock not in registered:
                                sel.register(conn.sock, selectors.EVENT_READ, conn)
                            elif not want and conn.sock in registered:
                                sel.unregister(conn.sock)
                    for key, _ in sel.select(_HELD_CHECK if self._held_any else None):
                        conn = key.data
                        if conn is None:
                            self._drain_wake()
                            continue
                        if not self._read(conn) or conn.held:
                            sel.unregister(conn.sock)
                finally:
                    with self._cv:
                        self._io_busy = False
                        self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - never die silently
            self._fatal(None, exc)
        finally:
            sel.close()

    def _fatal(self, conn: _Conn | None, exc: BaseException) -> bool:
        """An unexpected exception while reading: fail every waiter with a DistError
        that says what happened, and stop reading ``conn`` (its framing is lost)."""
        where = f" while reading from rank {conn.rank}" if conn is not None else ""
        err = DistError(f"the I/O thread of rank {self.rank} failed{where}: "
                        f"{type(exc).__name__}: {exc}")
        err.__cause__ = exc
        if conn is not None:
            conn.broken = err
            self._attend()
        handler = self._handler
        if handler is not None and not self._closing:
            try:
                handler.on_fatal(err)
            except Exception:  # noqa: BLE001, S110 - nothing better left to do
                pass
        return False

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        if self._closing:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._links is not None:
            self._links.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._adding:  # (a connection being adopted now is refused, not leaked)
            conns = self._conns
        for conn in conns:
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

