"""torch's own ``TCPStore`` behind rankwise's store port, for scripts that use only torch.

Why: a script that never imports rankwise calls ``init_process_group("gloo")`` with
``env://``; torch's client connects to ``MASTER_PORT`` and speaks only torch's store
protocol. ``MASTER_PORT`` stays rankwise's token-protected store (rankwise ranks and every
script that opens it there are unchanged). The store recognises torch's client by its first
bytes (``store.foreign``) and hands the connection to :class:`TorchStoreHost`, which relays
it, bytes unchanged, to torch's own ``TCPStore`` server, hosted in this launcher on a
loopback-only port that nothing else is told about. A torch client so reaches torch's keys
only: rankwise's keys are behind rankwise's handshake, on another server
(docs/design.md, "Plain torch scripts under rankwise run").

Cheap when unused: torch is imported (seconds) only when a first torch client knocks, so a
job of rankwise ranks never imports it in the launcher; that knock is also how the launcher
learns that plain torch ranks run, and it says once what they do not get. Each attempt
gets a fresh torch store (``begin_attempt``): torch's keys of a failed attempt must not
meet the next attempt's ranks. One thread relays every connection (a selector), so the
launcher holds no thread per rank.
"""

from __future__ import annotations

import importlib.util
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["PLAIN_TORCH_LINE", "TorchStoreHost", "torch_installed"]

#: what the launcher says once when plain torch ranks reach the store
PLAIN_TORCH_LINE = (
    "rankwise run: ranks use torch.distributed without rankwise (served by torch's own "
    "store behind MASTER_PORT): they get this launcher's failure summary, watchdog, restarts "
    "and node heartbeats, not rankwise's per-call checks. To add those, change one line: "
    "`import rankwise.torch` and backend \"rankwise\", or `import rankwise as dist`."
)

_READ = 64 * 1024
#: bytes a relayed connection may have waiting for its other side: torch's store traffic is
#: small, and an unauthenticated client must not grow the launcher without bound
_MAX_PENDING = 64 << 20


def torch_installed() -> bool:
    """Whether this interpreter could host torch's store (found, not imported)."""
    return importlib.util.find_spec("torch") is not None


class _Pair:
    """One relayed connection: the torch client's socket and ours to torch's server."""

    def __init__(self, client: socket.socket, upstream: socket.socket, first: bytes) -> None:
        self.ends = (client, upstream)
        self.pending: dict[socket.socket, bytearray] = {client: bytearray(),
                                                        upstream: bytearray(first)}

    def other(self, sock: socket.socket) -> socket.socket:
        return self.ends[1] if sock is self.ends[0] else self.ends[0]


class TorchStoreHost:
    """Serves torch clients that knock on rankwise's store with torch's own store."""

    def __init__(self, say: Callable[[str], None], line: str | None = PLAIN_TORCH_LINE) -> None:
        """``line``: said at the first knock (None under ``--checks``, where plain torch
        groups are rankwise's and a knock is some other TCPStore client, e.g. torch's
        debug server)."""
        self._say = say
        self._line = line
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._pairs: dict[socket.socket, _Pair] = {}
        self._server: Any = None
        self._server_port = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: set once a torch client reached the store: plain torch ranks run
        self.used = threading.Event()

    # --- any thread ---------------------------------------------------------------------
    def take(self, client: socket.socket, first: bytes) -> bool:
        """The store's ``on_torch_client``: relay this connection (False: no torch here, or
        closed; the store then tells its ``on_foreign`` listener). Never blocks."""
        if self._closed or not torch_installed():
            return False
        if not self.used.is_set():
            self.used.set()
            if self._line:
                self._say(self._line)
        self._post("client", (client, first))
        return True

    def begin_attempt(self, attempt: int) -> None:
        """A new attempt: the last one's torch store and connections go (next knock: a
        fresh store)."""
        if attempt > 0:
            self._post("reset", None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()
            return
        self._post("stop", None)
        thread.join(timeout=30.0)

    def _post(self, what: str, item: Any) -> None:
        with self._lock:
            if self._thread is None and what == "client":
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rankwise-torch-store")
                self._thread.start()
        self._inbox.put((what, item))
        self._wake_w.send(b"x")

    # --- the relay thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for key, mask in self._sel.select():
                    sock = key.fileobj
                    if sock is self._wake_r:
                        if not self._commands():
                            return
                    else:
                        assert isinstance(sock, socket.socket)
                        self._relay(sock, mask)
        finally:
            self._reset()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _commands(self) -> bool:
        self._wake_r.recv(4096)
        while True:
            try:
                what, item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if what == "stop":
                return False
            if what == "reset":
                self._reset()
            else:
                self._connect(*item)

    def _ensure_server(self) -> int:
        """torch's server on a loopback port of its own (started at the first knock)."""
        if self._server is None:
            import torch.distributed as tdist  # seconds: only when a torch client came

            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))  # loopback only: reached through the relay
            listener.listen(1024)
            port = listener.getsockname()[1]
            try:
                self._server = tdist.TCPStore(  # type: ignore[attr-defined]
                    "127.0.0.1", port, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=60), master_listen_fd=listener.detach())
            except BaseException:
                listener.close()
                raise
            self._server_port = port
        return self._server_port

    def _connect(self, client: socket.socket, first: bytes) -> None:
        try:
            port = self._ensure_server()
            upstream = socket.create_connection(("127.0.0.1", port), timeout=10.0)
        except (ImportError, RuntimeError, OSError) as exc:
            self._say(f"rankwise run: warning: torch's store could not serve a torch "
                      f"client ({exc})")
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream, first)
        self._pairs[client] = self._pairs[upstream] = pair
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(upstream, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _relay(self, sock: socket.socket, mask: int) -> None:
        pair = self._pairs.get(sock)
        if pair is None:
            return
        try:
            if mask & selectors.EVENT_READ:
                data = sock.recv(_READ)
                if not data:
                    raise ConnectionError("closed")
                peer = pair.other(sock)
                pair.pending[peer] += data
                if len(pair.pending[peer]) > _MAX_PENDING:
                    raise ConnectionError("its other side does not read")
                self._flush(pair, peer)
            if mask & selectors.EVENT_WRITE:
                self._flush(pair, sock)
        except OSError:  # either side hung up: so does the other
            self._drop(pair)

    def _flush(self, pair: _Pair, sock: socket.socket) -> None:
        out = pair.pending[sock]
        if out:
            try:
                sent = sock.send(out)
            except BlockingIOError:
                sent = 0
            del out[:sent]
        self._sel.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0))

    def _drop(self, pair: _Pair) -> None:
        for sock in pair.ends:
            if self._pairs.pop(sock, None) is not None:
                self._sel.unregister(sock)
            sock.close()

    def _reset(self) -> None:
        for pair in list({id(p): p for p in self._pairs.values()}.values()):
            self._drop(pair)
        server, self._server = self._server, None
        del server  # torch's server stops (closing its listening socket) when freed
