"""``TCPStoreServer``: the rendezvous server, hosted by rank 0 or by the launcher.

Design (why it looks like this):

* One listening socket bound *only* to the address asked for (``localhost`` stays on
  loopback; all interfaces only when the caller passes ``"0.0.0.0"``/``"::"``).
* One thread serves every client (``store.loop``: a ``selectors`` event loop), so the
  number of clients is bounded by the fd limit only, not by threads. A blocked
  ``get``/``wait`` is parked as a waiter on the keys it misses: a write wakes only the
  waiters of its key, one slow waiter never delays another client, and nothing spins.
* Every connection passes the ``wire.auth`` handshake first; failures are logged at debug
  level only (a port scanner should not fill the job's log) and the server goes on.
* Every request is decoded by ``protocol.read_request`` with bounded lengths; an
  invalid frame drops that client only.
* ``close()`` closes the table and stops the loop, which answers parked waiters with a
  ``CLOSED`` reply, then shuts every connection down.
"""

from __future__ import annotations

import errno
import logging
import resource
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import AuthError, DistNetworkError, InvalidArgument, StoreError
from ..transport.keepalive import heartbeat_timeout
from ..wire.auth import resolve_token
from .base import AUTH_FAILURES_KEY
from .foreign import ForeignKnock, describe_foreign_client
from .loop import StoreLoop, Waiting
from .protocol import (
    DEFAULT_LIMITS,
    Limits,
    Op,
    Request,
    Status,
    decode_int,
    encode_int,
)
from .table import KVTable, TableClosed

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+

__all__ = ["TCPStoreServer", "resolve_bind_address"]

log = logging.getLogger(__name__)

PURPOSE = "store"
_WILDCARDS = ("0.0.0.0", "::")


def resolve_bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """The (family, sockaddr) to bind for ``host``; IPv4 preferred when both exist."""
    if not isinstance(host, str) or not host:
        raise InvalidArgument(
            'store host must be a non-empty str; pass "0.0.0.0" explicitly to listen on all '
            "interfaces"
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DistNetworkError(
            f"cannot resolve store host {host!r}: {exc}. Check MASTER_ADDR."
        ) from exc
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, _, _, _, sockaddr = infos[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


class TCPStoreServer:
    """The store server alone, without a client (the launcher hosts one like this).

    ``TCPStoreServer(host, port)`` does not touch the network until ``start()`` (or
    ``with``); ``port=0`` picks a free port, readable as ``.port`` afterwards.
    ``on_foreign`` is called (from the server's thread, before the connection closes) for every
    client recognised as another system's, e.g. torch's TCPStore (``store.foreign``).
    ``on_torch_client(sock, first_bytes)`` may take a torch TCPStore client's connection
    instead (return True: the server forgets it, unclosed): ``rankwise run`` serves it
    with torch's own store (``launch.torch_store``). It must not block.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        token: str | bytes | None = None,
        *,
        limits: Limits = DEFAULT_LIMITS,
        handshake_timeout: float = 30.0,
        frame_timeout: float = 60.0,
        max_connections: int | None = None,
        on_foreign: Callable[[ForeignKnock], None] | None = None,
        on_torch_client: Callable[[socket.socket, bytes], bool] | None = None,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgument(f"store port must be an int in 0..65535, got {port!r}")
        if not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be a Limits, got {type(limits).__name__}")
        self._family, self._addr = resolve_bind_address(host, port)
        self._host = host
        self._token = resolve_token(token)
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._frame_timeout = frame_timeout
        #: default: as many as the fd limit allows (a few kept for the server itself)
        self._max_connections = max_connections if max_connections is not None else \
            max(resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 16, 1)
        self._table = KVTable(limits.max_total_bytes)
        self._auth_failures = 0
        self._on_foreign = on_foreign
        self._on_torch_client = on_torch_client
        self._listener: socket.socket | None = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._loop: StoreLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def port(self) -> int:
        """The port listened on (the chosen one when constructed with ``port=0``)."""
        if self._port is None:
            raise StoreError("TCPStoreServer.port is known only after start()")
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def address(self) -> tuple[str, int]:
        """The bound socket address (what ``getsockname()`` returns)."""
        if self._listener is None:
            raise StoreError("TCPStoreServer is not started")
        name = self._listener.getsockname()
        return str(name[0]), int(name[1])

    def start(self) -> Self:
        """Bind, listen and start serving; ``DistNetworkError`` if the port is taken."""
        if self._listener is not None:
            return self
        if self._closed:
            raise StoreError("TCPStoreServer was closed; create a new one")
        keepalive_s = heartbeat_timeout()  # a bad value is refused before binding
        listener = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            # Lets a restarted job reuse a port in TIME_WAIT; on Linux it still refuses
            # a port another socket is listening on.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(self._addr)
            listener.listen(min(socket.SOMAXCONN, 1024))
        except OSError as exc:
            listener.close()
            addr = f"{self._addr[0]}:{self._addr[1]}"
            if exc.errno == errno.EADDRINUSE:
                raise DistNetworkError(
                    f"cannot start the rankwise store on {addr}: the port is already in use "
                    f"(another job or store listens there). Set MASTER_PORT to a free port, "
                    f"or use port 0 to let the system pick one."
                ) from exc
            raise DistNetworkError(
                f"cannot start the rankwise store on {addr}: {exc}. Check MASTER_ADDR names "
                f"an address of this machine."
            ) from exc
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._loop = StoreLoop(
            listener, self._token, PURPOSE, self._limits, self._handshake_timeout,
            self._frame_timeout, self._max_connections, self._dispatch,
            self._missing, self._note_auth_failure, self._tell_foreign, keepalive_s)
        self._thread = threading.Thread(
            target=self._loop.run, name=f"rankwise-store:{self._port}", daemon=True)
        self._thread.start()
        return self

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop serving: wake blocked waiters, drop every client, free the port."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._table.close()
        if self._loop is not None:
            self._loop.stop()
        if self._thread is not None:
            self._thread.join(join_timeout)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _tell_foreign(self, head: bytes, conn: socket.socket) -> bool:
        """A recognised foreign client (torch's TCPStore): ``on_torch_client`` may take
        it (True); else tell ``on_foreign`` at every knock, before the connection closes
        (the listener may look up who holds its other end). Such a client retries for its
        whole timeout and nothing else says why it cannot join; the listener decides what
        to print and whether to act."""
        what = describe_foreign_client(head)
        if what is None:
            return False
        try:
            if self._on_torch_client is not None and self._on_torch_client(conn, head):
                return True
        except Exception:  # a listener's bug must not take the store down
            log.exception("store: on_torch_client listener failed")
        if self._on_foreign is None:
            return False
        try:
            host, port = conn.getpeername()[:2]
            store_port = conn.getsockname()[1]
        except OSError:
            return False  # already gone: it will knock again
        try:
            self._on_foreign(ForeignKnock(what, str(host), int(port), int(store_port)))
        except Exception:  # a listener's bug must not take the store down
            log.exception("store: on_foreign listener failed")
        return False

    def _note_auth_failure(self, peer: str, exc: AuthError) -> None:
        """Remember (bounded) that ``peer`` failed the token check, for the ranks that
        wait for a rank that will never arrive. Nothing else happens: a stranger failing
        the check must not be able to abort a job."""
        with self._lock:
            self._auth_failures += 1
            count = self._auth_failures
        note = f"{count} connection(s) failed the token check; the last, from {peer}: {exc}"
        try:
            self._table.set(AUTH_FAILURES_KEY, note[:1000].encode())
            if self._loop is not None:
                self._loop.written(AUTH_FAILURES_KEY)
        except StoreError:  # closed, or full: the note is a courtesy
            pass
        log.debug("store: %s", note)

    def _missing(self, keys: list[bytes]) -> list[bytes]:
        return self._table.wait(keys, 0.0)

    def _dispatch(self, req: Request) -> tuple[Status, list[bytes]] | Waiting:
        """Run one request against the table (never blocking): the reply, or ``Waiting``
        for a ``get``/``wait`` whose keys are missing (the loop parks it on them)."""
        f = req.fields
        table = self._table
        try:
            if req.op is Op.GET:
                value = table.get(f[0], 0.0)
                if value is not None:
                    return Status.OK, [value]
                return self._wait_or_timeout([f[0]], [f[0]], decode_int(f[1]))
            if req.op is Op.WAIT:
                missing = table.wait(list(f[1:]), 0.0)
                if not missing:
                    return Status.OK, []
                return self._wait_or_timeout(list(f[1:]), missing, decode_int(f[0]))
            if req.op is Op.CHECK:
                return Status.OK, [encode_int(int(table.check(list(f))))]
            if req.op is Op.DELETE:
                return Status.OK, [encode_int(int(table.delete(f[0])))]
            if req.op is Op.NUM_KEYS:
                return Status.OK, [encode_int(table.num_keys())]
            reply = self._write(req)
            assert self._loop is not None
            self._loop.written(f[0])  # wakes only the waiters of this key
            return reply
        except TableClosed:
            return Status.CLOSED, [b"the store server is shutting down"]
        except StoreError as exc:
            return Status.ERROR, [str(exc).encode("utf-8")[:4096]]

    def _write(self, req: Request) -> tuple[Status, list[bytes]]:
        f = req.fields
        if req.op is Op.SET:
            self._table.set(f[0], f[1])
            return Status.OK, []
        if req.op is Op.ADD:
            return Status.OK, [encode_int(self._table.add(f[0], decode_int(f[1])))]
        if req.op is Op.COMPARE_SET:
            return Status.OK, [self._table.compare_set(f[0], f[1], f[2])]
        raise AssertionError(f"unhandled opcode {req.op!r}")  # schemas cover every Op

    def _wait_or_timeout(self, keys: list[bytes], missing: list[bytes],
                         timeout_ms: int) -> tuple[Status, list[bytes]] | Waiting:
        if self._closed:
            raise TableClosed("the store was shut down")
        if timeout_ms <= 0:
            return Status.TIMEOUT, missing
        return Waiting(keys, set(missing), _ms_to_s(timeout_ms))


def _ms_to_s(ms: int) -> float:
    return max(ms, 0) / 1000.0
