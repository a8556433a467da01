"""Building the full mesh of authenticated TCP connections between the ranks of a job.

Each rank listens on an ephemeral port of the interface that reaches the master
(loopback when the master is local), publishes ``host:port`` in the rendezvous store,
then connects to every lower rank and accepts every higher one. Every connection
passes the token handshake (``wire.auth``) and a hello that names the job and the rank, so
a stray or stale process (an earlier attempt of a restarted job, another job on the same
ports) is refused instead of silently joining.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .. import settings
from ..errors import AuthError, DistError, DistNetworkError, DistTimeout, RendezvousError
from . import crowding
from .hello import Hello
from .resources import exhausted, retryable

__all__ = ["HANDSHAKE_TIMEOUT", "Exits", "Mesh", "address_blob", "address_keys", "address_of",
           "exited_peers", "gather_addresses", "local_address_for", "open_listener",
           "out_of_resource"]


class Exits(Protocol):
    """What reading the launcher's ``exited/`` keys takes of a store."""

    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...


class _KV(Exits, Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...
    def wait(self, keys: list[str], timeout: float) -> None: ...


#: how long one incoming connection may take to prove itself (token and hello); a
#: connection that says nothing is dropped after this, never holding up the others
HANDSHAKE_TIMEOUT = settings.number("RANKWISE_HANDSHAKE_TIMEOUT")
_CHECK_EVERY = 0.25  # how often a waiting rank looks for news from the launcher
_CONNECTORS = 16  #: connections opened at once (each a blocking handshake)
_KEYS_PER_WAIT = 4096  #: the store's ``Limits.max_keys``
_QUIET = 1.0  #: seconds the higher ranks get to connect before the first look for ended ones
_NOTICE_WAIT = 2.0  #: how long a cut handshake waits for the launcher to say the peer ended


def exited_peers(store: Exits, ranks: list[int]) -> dict[int, str]:
    """Which of ``ranks`` the launcher reported as ended (``exited/<rank>``), and how.

    The launcher counts every worker that ends under ``exited/count``; only when that
    count moved are the ranks' keys read."""
    try:
        if not ranks or int(store.add("exited/count", 0)) == 0:
            return {}
        return {r: store.get(f"exited/{r}").decode("utf-8", "replace")
                for r in ranks if store.check([f"exited/{r}"])}
    except (DistError, ValueError):
        return {}


def local_address_for(master_addr: str) -> str:
    """The address of this host's interface that routes to ``master_addr``."""
    try:
        infos = socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)
        ip = str(infos[0][4][0])
    except OSError:
        return "127.0.0.1"
    if ip.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))  # UDP connect sends nothing; it only picks the route
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def open_listener(rank: int, world_size: int, bind_host: str) -> socket.socket:
    """The socket ``rank`` takes its data connections on (an ephemeral port)."""
    listener = _open_listener_socket(rank)
    try:
        listener.bind((bind_host, 0))
    except OSError as exc:
        listener.close()
        raise DistNetworkError(
            f"rank {rank} could not listen on {bind_host}: {exc}; set "
            "RANKWISE_BIND_ADDR to an address of this host that the other ranks reach"
        ) from exc
    listener.listen(max(world_size, 8))
    return listener


def _open_listener_socket(rank: int) -> socket.socket:
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise out_of_resource(exc, f"rank {rank} could not open its listening socket") from exc


def out_of_resource(exc: OSError, doing: str) -> DistNetworkError:
    """``doing`` failed with ``exc``: the error to raise at once on this rank, naming the
    local resource that ran out and its limit when it is one (``resources``)."""
    what = exhausted(exc)
    return DistNetworkError(f"{doing}: {what} ({exc})" if what else f"{doing}: {exc}")


def address_of(listener: socket.socket) -> str:
    """``listener``'s entry in the address blob: ``host:port cpus`` (``crowding``)."""
    host, port = listener.getsockname()[:2]
    return crowding.entry(host, port)


class _ManyReads(Protocol):
    def read_many(self, keys: list[str]) -> list[bytes | None]: ...


def gather_addresses(store: _ManyReads, world_size: int) -> str | None:
    """The address blob (every rank's entry, in rank order), read by the last rank to
    join a rendezvous in which each rank published its entry before counting itself in;
    None when some rank published none (it asked for another transport: its own mesh
    then gathers them, as without a rendezvous)."""
    return address_blob(store.read_many(address_keys(world_size)))  # one trip


def address_keys(world_size: int) -> list[str]:
    """The keys of every rank's address entry, in rank order (``gather_addresses``)."""
    return [f"mesh/addr/{r}" for r in range(world_size)]


def address_blob(values: list[bytes | None]) -> str | None:
    """The address blob of the entries read at ``address_keys``; None when one is missing."""
    if any(value is None for value in values):
        return None
    return "\n".join(value.decode() for value in values if value is not None)


class Mesh:
    """Connects ``rank`` to every other rank (or to ``peers``, the ones another transport
    does not serve); ``connect()`` returns ``{peer: socket}``. ``publish()`` only listens
    and learns the addresses, for connections opened later, on demand."""

    def __init__(self, rank: int, world_size: int, store: _KV, job: bytes, token: bytes | None,
                 bind_host: str, timeout: float, listener: socket.socket | None = None,
                 blob: str | None = None) -> None:
        """``listener`` and ``blob``: a listener whose address this rank published during
        the rendezvous, and every rank's address as the last to join gathered them
        (``api.init``); the mesh then publishes and gathers nothing itself."""
        self._prebound = listener
        self._blob = blob
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self.hello = Hello(rank, world_size, job, token)
        self._bind_host = bind_host
        self._timeout = timeout
        self._socks: dict[int, socket.socket] = {}
        self._errors: list[BaseException] = []
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  #: a socket or an error arrived
        self._pending: set[socket.socket] = set()  #: accepted, still proving themselves
        self._stop = threading.Event()
        self._peers = set(range(world_size)) - {rank}
        #: some host runs more ranks than CPUs (``crowding``); known once the blob is read
        self.crowded = False

    def exchange(self, name: str, value: str) -> list[str]:
        """Every rank's ``value`` for ``name``, in rank order (one store round; each rank
        calls it). A rank the launcher saw end is named, never waited for in vain."""
        deadline = time.monotonic() + self._timeout
        self._store.set(f"mesh/{name}/{self.rank}", value)
        out = []
        for peer in range(self.world_size):
            key = f"mesh/{name}/{peer}"
            self._await_key(key, peer, deadline, f"its {name}")
            out.append(self._store.get(key).decode("utf-8", "replace"))
        return out

    def connect(self, peers: set[int] | None = None) -> dict[int, socket.socket]:
        """Open the connections to ``peers`` (default: every other rank). Each pair of
        ranks must agree on whether they connect (``transport.factory`` ensures it)."""
        if peers is not None:
            self._peers = set(peers) - {self.rank}
        if not self._peers:
            return {}
        full = len(self._peers) == self.world_size - 1  # every rank takes part
        deadline = time.monotonic() + self._timeout
        listener = self._listen()
        try:
            self._announce(listener)
            acceptor = threading.Thread(target=self._accept_all, args=(listener, deadline),
                                        name="rankwise-mesh-accept", daemon=True)
            acceptor.start()
            lower = sorted(p for p in self._peers if p < self.rank)
            addrs = self._addresses(deadline) if full else {}
            with ThreadPoolExecutor(min(_CONNECTORS, max(len(lower), 1)),
                                    thread_name_prefix="rankwise-mesh-connect") as pool:
                for done in [pool.submit(self._connect_to, p, deadline, addrs.get(p))
                             for p in lower]:
                    done.result()  # the first error (by rank) is the one raised
            self._await_higher(deadline)
        finally:
            with self._changed:  # atomic with a handover in _accept_one: a socket is in
                self._stop.set()  # _pending or in _socks, never both
                pending = list(self._pending)
                self._pending.clear()
            listener.close()
            for sock in pending:
                sock.close()  # handshakes still running (strangers): cut them short
        if self._errors:
            raise self._errors[0]
        missing = self._missing()
        if missing:
            raise DistTimeout(
                f"rank {self.rank}: ranks {missing} did not open their data connections "
                f"within {self._timeout:.0f}s after rendezvous"
            )
        return dict(self._socks)

    def publish(self) -> tuple[socket.socket, dict[int, str]]:
        """Listen and learn every rank's address, connecting to nobody: for connections
        opened on demand (``links``). Returns the listener, kept for the job's lifetime,
        and ``{rank: "host:port"}``."""
        deadline = time.monotonic() + self._timeout
        listener = self._listen()
        try:
            self._announce(listener)
            return listener, self._addresses(deadline)
        except BaseException:
            listener.close()
            raise

    def _missing(self) -> list[int]:
        with self._lock:
            return sorted(self._peers - set(self._socks))

    def _raise_if_exited(self, peers: list[int]) -> None:
        """A peer the launcher saw end will never connect: say so now, naming it."""
        gone = exited_peers(self._store, peers)
        if gone:
            peer, how = min(gone.items())
            raise RendezvousError(
                f"rank {self.rank}: rank {peer} {how} before it opened its data connections "
                f"(during init_process_group); the job cannot be formed without it")

    def _await_exit_notice(self, peer: int) -> None:
        """``peer`` cut the handshake: if it is dying, raise naming it, not our broken
        connection. Its launcher's notice comes within milliseconds; the wait is bounded
        (``_NOTICE_WAIT``), so a live peer's error is raised as it was, a moment later."""
        limit = time.monotonic() + _NOTICE_WAIT
        while True:
            self._raise_if_exited([peer])
            if time.monotonic() >= limit:
                return
            self._stop.wait(_CHECK_EVERY / 5)

    def _await_higher(self, deadline: float) -> None:
        """Wait until every higher rank has connected, an error, an ended peer, or the
        deadline."""
        quiet = time.monotonic() + _QUIET  # a store round trip per look: none at first
        with self._changed:
            while True:
                if self._errors or not self._missing():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(min(left, _CHECK_EVERY))
                # no handshake in flight could still be one of them
                if not self._pending and time.monotonic() >= quiet:
                    self._raise_if_exited(self._missing())

    def _listen(self) -> socket.socket:
        if self._prebound is not None:
            return self._prebound
        return open_listener(self.rank, self.world_size, self._bind_host)

    def _announce(self, listener: socket.socket) -> None:
        if listener is not self._prebound:  # (else the rendezvous published it)
            self._store.set(f"mesh/addr/{self.rank}", address_of(listener))

    def _addresses(self, deadline: float) -> dict[int, str]:
        """Every rank's data address, from one blob rank 0 gathers and publishes: O(N)
        store requests for the whole job instead of one wait and read per pair."""
        if self._blob is not None:
            blob = self._blob
        elif self.rank == 0:
            for start in range(0, self.world_size, _KEYS_PER_WAIT):
                keys = [f"mesh/addr/{p}" for p in range(start, min(start + _KEYS_PER_WAIT,
                                                                   self.world_size))]
                self._await_keys(keys, deadline)
            blob = "\n".join(self._store.get(f"mesh/addr/{p}").decode()
                             for p in range(self.world_size))
            self._store.set("mesh/addrs", blob)
        else:
            self._await_keys(["mesh/addrs"], deadline)
            blob = self._store.get("mesh/addrs").decode()
        lines = blob.split("\n")
        self.crowded = crowding.crowded(lines)
        return {r: crowding.parse(line)[0] for r, line in enumerate(lines)}

    def _await_keys(self, keys: list[str], deadline: float) -> None:
        """Wait (on the store, not by polling) until ``keys`` exist; ranks the launcher saw
        end are named, looked for every ``_CHECK_EVERY * 4``."""
        while True:
            left = deadline - time.monotonic()
            try:
                self._store.wait(keys, max(min(left, _CHECK_EVERY * 4), 0.01))
                return
            except DistTimeout:
                self._raise_if_exited(sorted(self._peers))
                if time.monotonic() >= deadline:
                    raise DistTimeout(f"rank {self.rank}: the ranks' data addresses were not "
                                      f"all published within {self._timeout:.0f}s after "
                                      "rendezvous") from None

    def _connect_to(self, peer: int, deadline: float, addr: str | None = None) -> None:
        if addr is None:
            key = f"mesh/addr/{peer}"
            self._await_key(key, peer, deadline, "its data address")
            addr = crowding.parse(self._store.get(key).decode())[0]
        host, _, port_s = addr.rpartition(":")
        checked = time.monotonic()
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, int(port_s)), timeout=max(remaining, 0.1))
                break
            except OSError as exc:
                if not retryable(exc):  # this host ran out of something: retrying cannot help
                    raise out_of_resource(exc, f"rank {self.rank} could not connect to rank "
                                               f"{peer} at {addr}") from exc
                if time.monotonic() - checked > _CHECK_EVERY:
                    self._raise_if_exited([peer])
                    checked = time.monotonic()
                if remaining <= 0:
                    raise DistNetworkError(
                        f"rank {self.rank} could not connect to rank {peer} at {addr}: {exc}"
                    ) from exc
                time.sleep(min(0.05, max(remaining, 0.0)))
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1.0))
            self.hello.as_client(sock, peer, addr)
        except DistNetworkError:
            sock.close()
            self._await_exit_notice(peer)
            raise
        except BaseException:
            sock.close()
            raise
        with self._changed:
            self._socks[peer] = sock
            self._changed.notify_all()

    def _await_key(self, key: str, peer: int, deadline: float, what: str) -> None:
        while not self._store.check([key]):
            self._raise_if_exited([peer])
            if time.monotonic() >= deadline:
                raise DistTimeout(f"rank {self.rank}: rank {peer} did not publish {what} "
                                  f"within {self._timeout:.0f}s after rendezvous")
            self._stop.wait(_CHECK_EVERY / 5)

    def _accept_all(self, listener: socket.socket, deadline: float) -> None:
        """Accept until every higher rank is connected; each connection proves itself on
        a thread of its own, within ``HANDSHAKE_TIMEOUT``, so one that stays silent (a
        port scanner, a stuck stranger) never delays the honest ones."""
        expected = {p for p in self._peers if p > self.rank}
        try:
            while not self._stop.is_set() and expected - set(self._socks):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:  # (settimeout too: connect() may close the listener at any point)
                    listener.settimeout(min(remaining, _CHECK_EVERY))
                    sock, addr = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._stop.is_set():
                        return  # the listener was closed: connect() is done
                    raise out_of_resource(exc, f"rank {self.rank} could not accept a data "
                                               "connection") from exc
                limit = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT)
                with self._changed:
                    self._pending.add(sock)
                threading.Thread(target=self._handshake, name="rankwise-mesh-handshake",
                                 args=(sock, f"{addr[0]}:{addr[1]}", limit, expected),
                                 daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - surfaced in connect()
            if self._stop.is_set():
                return  # connect() has decided: an error now is of the closing, not of it
            with self._changed:
                self._errors.append(exc)
                self._changed.notify_all()

    def _handshake(self, sock: socket.socket, addr: str, limit: float,
                   expected: set[int]) -> None:
        try:
            self._accept_one(sock, addr, limit, expected)
        except (AuthError, DistNetworkError, OSError):
            sock.close()  # a stranger, or too slow: refuse it and keep waiting for peers
        except BaseException as exc:  # noqa: BLE001 - surfaced in connect()
            sock.close()
            with self._changed:
                self._errors.append(exc)
        finally:
            with self._changed:
                self._pending.discard(sock)
                self._changed.notify_all()

    def _accept_one(self, sock: socket.socket, addr: str, limit: float,
                    expected: set[int]) -> None:
        sock.settimeout(max(limit - time.monotonic(), 0.1))
        peer = self.hello.as_server(sock, addr, expected.__contains__)
        with self._changed:
            if peer in self._socks:
                self._errors.append(RendezvousError(
                    f"two processes claim rank {peer} (second one from {addr}); every process "
                    "needs a distinct RANK"))
                sock.close()
                return
        sock.sendall(self.hello.mine())
        sock.settimeout(None)
        with self._changed:
            if self._stop.is_set():  # connect() is done and closed what was pending
                raise DistNetworkError(f"rank {peer} from {addr} connected after init gave up")
            self._pending.discard(sock)  # handed over: connect()'s clean-up must not close it
            self._socks[peer] = sock
            self._changed.notify_all()
