"""Connections opened on demand: a rank connects to a peer the first time it sends to it.

Why: a full mesh costs every rank N-1 sockets (with their buffers) and N-1 handshakes at
init, while the collectives' algorithms talk to O(log N) peers; at 1,000 ranks the mesh
alone exceeds the default limit of 1,024 fds. So each rank only listens and learns every
rank's address at init (one blob, ``Mesh.publish``); ``TcpTransport`` dials a peer when it
first sends to it, and takes the connections peers open to it from the accept thread here.
Every connection proves itself with the same token handshake and hello as the mesh's;
a stranger is refused on its own short-lived thread, disturbing nobody. Measurements and
the failure rules: docs/scale.md, "Connections".
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

from ..errors import DistError, DistNetworkError, DistTimeout
from .hello import Hello
from .mesh import HANDSHAKE_TIMEOUT, Exits, exited_peers

__all__ = ["Links"]

log = logging.getLogger("rankwise")

_T = TypeVar("_T")


class _Attempt:
    """One dial to a peer, which every sender that needs the peer meanwhile waits for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None


class Links:
    """Dials peers at their published addresses; accepts and checks the peers that dial
    us, handing each proven connection to ``adopt(peer, sock)``."""

    def __init__(self, hello: Hello, listener: socket.socket, addrs: dict[int, str],
                 store: Exits | None = None) -> None:
        self.rank = hello.rank
        self.world_size = hello.world_size
        self._hello = hello
        self._listener = listener
        self._addrs = addrs
        self._store = store  #: only to word a refusal (did the launcher see it exit?)
        self._lock = threading.Lock()
        self._closed = False
        self._refused: dict[int, DistNetworkError] = {}  #: a peer that is gone stays gone
        self._attempts: dict[int, _Attempt] = {}  #: dials in flight, by peer
        self._pending: set[socket.socket] = set()  #: accepted, still proving themselves
        self._adopt: Callable[[int, socket.socket], object] | None = None
        self._thread: threading.Thread | None = None

    def start(self, adopt: Callable[[int, socket.socket], object]) -> None:
        """Begin accepting; ``adopt`` takes each proven incoming connection."""
        self._adopt = adopt
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"rankwise-accept-{self.rank}")
        self._thread.start()

    # --- dialing (sender threads) -------------------------------------------------------------

    def dialing(self, peer: int) -> bool:
        """Whether a dial to ``peer`` is in flight."""
        return peer in self._attempts

    def connect(self, peer: int, deadline: float,
                adopt: Callable[[int, socket.socket], _T]) -> _T:
        """``adopt(peer, sock)`` of a new connection to ``peer``; concurrent callers share
        one dial. A caller whose ``deadline`` comes first gets ``DistTimeout`` while the
        dial goes on in the background (its peer must not see a half-done handshake)."""
        with self._lock:
            attempt = self._attempts.get(peer)
            first = attempt is None
            if attempt is None:
                attempt = self._attempts[peer] = _Attempt()
        if first:
            if deadline - time.monotonic() >= HANDSHAKE_TIMEOUT:
                self._attempt(peer, attempt, adopt)
            else:
                threading.Thread(target=self._attempt, args=(peer, attempt, adopt),
                                 name="rankwise-dial", daemon=True).start()
        if not attempt.done.wait(max(deadline - time.monotonic(), 0.0)):
            raise DistTimeout(f"rank {self.rank} could not connect to rank {peer} before the "
                              f"timeout: rank {peer} did not finish the handshake (stopped, "
                              "hung or overloaded?)")
        if attempt.error is not None:
            raise DistNetworkError(str(attempt.error)) from attempt.error
        return cast(_T, attempt.result)

    def _attempt(self, peer: int, attempt: _Attempt,
                 adopt: Callable[[int, socket.socket], object]) -> None:
        try:
            attempt.result = adopt(peer, self.dial(peer, time.monotonic() + HANDSHAKE_TIMEOUT))
        except BaseException as exc:  # noqa: BLE001 - every waiter raises it
            attempt.error = exc
        finally:
            with self._lock:
                self._attempts.pop(peer, None)
            attempt.done.set()

    def dial(self, peer: int, deadline: float) -> socket.socket:
        """A proven connection to ``peer``. The TCP connect is bounded by ``deadline`` (and
        ``HANDSHAKE_TIMEOUT``); the handshake, once connected, by ``HANDSHAKE_TIMEOUT``
        alone: given up half-way, the peer would take our closing for our death."""
        refused = self._refused.get(peer)
        if refused is not None:
            raise refused
        addr = self._addrs.get(peer)
        if addr is None:
            raise DistNetworkError(f"rank {self.rank} has no address for rank {peer} (world "
                                   f"size {self.world_size})")
        host, _, port = addr.rpartition(":")
        limit = max(0.05, min(deadline - time.monotonic(), HANDSHAKE_TIMEOUT))
        try:
            sock = socket.create_connection((host, int(port)), timeout=limit)
        except OSError as exc:
            err = DistNetworkError(self._unreachable(peer, addr, exc))
            if isinstance(exc, ConnectionRefusedError):
                self._refused[peer] = err  # its listener is closed: it will not come back
            raise err from exc
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            self._hello.as_client(sock, peer, addr)
        except BaseException:
            sock.close()
            raise
        return sock

    def _unreachable(self, peer: int, addr: str, exc: OSError) -> str:
        text = f"rank {self.rank} could not connect to rank {peer} at {addr}: {exc}"
        if not isinstance(exc, ConnectionRefusedError):
            return text + f" (host unreachable, or rank {peer} is hung)"
        how = exited_peers(self._store, [peer]).get(peer) if self._store is not None else None
        if how:
            return text + f": rank {peer} {how}"
        return text + (f": rank {peer} no longer listens (it exited, crashed, or destroyed "
                       "its process group)")

    # --- accepting (one thread, plus one short-lived thread per connection) ------------------

    def _accept_loop(self) -> None:
        warned = False
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                if not warned:  # out of fds, most likely: the dialer's handshake times out
                    log.warning("rankwise: rank %d could not accept a connection: %s",
                                self.rank, exc)
                    warned = True
                time.sleep(0.05)  # a back-off, until fds are freed
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._pending.add(sock)
            threading.Thread(target=self._greet, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="rankwise-greet", daemon=True).start()

    def _greet(self, sock: socket.socket, addr: str) -> None:
        """Let ``sock`` prove itself within ``HANDSHAKE_TIMEOUT``; a stranger, a silent
        one or a rank that claims to be us is refused and closed, nothing else changes."""
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            peer = self._hello.as_server(sock, addr, self._is_peer)
            sock.sendall(self._hello.mine())
        except (DistError, OSError) as exc:
            log.debug("rankwise: rank %d refused %s: %s", self.rank, addr, exc)
            with self._lock:
                self._pending.discard(sock)
            sock.close()
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._pending.discard(sock)
        assert self._adopt is not None
        try:
            self._adopt(peer, sock)
        except DistError:
            pass  # the transport is closing: it closed the socket

    def _is_peer(self, rank: int) -> bool:
        return 0 <= rank < self.world_size and rank != self.rank

    def close(self) -> None:
        """Stop accepting; cut short the handshakes still running."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for sock in pending:
            sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
