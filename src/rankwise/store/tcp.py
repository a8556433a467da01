"""``TCPStore``: the rendezvous store client (and, on the master, its server).

Why it is built this way:

* Connecting retries with backoff until the store timeout, because rank 0 (or the
  launcher) may open the port after the workers start. A later *re*connect, after a
  connection broke, tries once: the server is then known to have gone away and
  waiting the full timeout again would only hide that.
* A wrong or missing token ends in ``AuthError`` on the first attempt; it is never
  retried, so it surfaces in milliseconds, not after the timeout. With
  ``prove_with_first_request`` (``init_process_group``'s store) the token's proof goes
  out in one write with the first request, a round trip less on a slow link; a wrong
  token then raises from that request. The server handles nothing before the proof
  passed, and the client reads no reply before the server proved itself.
* One lock serialises request/response pairs, so one client object may be shared by
  threads (a thread blocked in ``get`` holds it; use one client per thread for
  independent blocking waits).
* ``get``/``wait`` send their timeout to the server, which answers ``TIMEOUT`` in time;
  the connection therefore stays in sync and usable afterwards. The socket timeout is a
  safety net a little longer than that; if it fires the connection is dropped and
  re-established on the next call.
"""

from __future__ import annotations

import errno
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

from ..errors import AuthError, DistNetworkError, DistTimeout, InvalidArgument, StoreError
from ..transport.keepalive import heartbeat_timeout, keep_alive
from ..transport.resources import exhausted
from ..wire.auth import PendingProof, client_handshake, client_hello, resolve_token
from .base import _NEVER, DEFAULT_TIMEOUT, WATCH_SLICE, Store, Watcher
from .protocol import (
    DEFAULT_LIMITS,
    INT64_MAX,
    Limits,
    Op,
    ProtocolError,
    Response,
    Status,
    decode_int,
    encode_int,
    encode_request,
    read_response,
)
from .tcp_server import PURPOSE, TCPStoreServer

__all__ = ["TCPStore", "connect_store_socket", "open_store_socket", "requests_sent",
           "round_trips"]

_REPLY_GRACE_S = 10.0  # how much longer than a server-side wait the socket may block
_WORKERS_KEY = b"\x00rankwise/store/workers"
_WORKERS_DONE_KEY = b"\x00rankwise/store/workers_done"
_LOCAL_FOR_WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def connect_store_socket(
    host: str, port: int, token: bytes | None, timeout_s: float, retry: bool = True
) -> socket.socket:
    """An authenticated socket to the store at ``host:port``.

    Retries refused/unreachable connects with backoff (10 ms doubling to 1 s) until
    ``timeout_s`` has passed when ``retry``; raises ``DistNetworkError`` saying what to
    check, or ``AuthError`` as soon as the handshake is refused.
    """
    return open_store_socket(host, port, token, timeout_s, retry)[0]


def open_store_socket(
    host: str, port: int, token: bytes | None, timeout_s: float, retry: bool = True,
    defer_proof: bool = False,
) -> tuple[socket.socket, PendingProof | None]:
    """``connect_store_socket``; with ``defer_proof`` the token's proof is left to go out
    with the first request (``PendingProof``; None when there is no token)."""
    peer = f"{host}:{port}"
    keepalive_s = heartbeat_timeout()  # a bad value is refused before any I/O
    start = time.monotonic()
    deadline = start + timeout_s
    delay = 0.01
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(0.05, min(remaining, 10.0)))
        except OSError as exc:
            if exhausted(exc):  # this host ran out of something: retrying cannot help
                raise DistNetworkError(f"could not connect to the rankwise store at {peer}: "
                                       f"{exhausted(exc)} ({exc})") from exc
            last: Exception = exc
        else:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(sock, keepalive_s)  # a cut-off store host: an error, not a hang
                sock.settimeout(max(remaining, 1.0))
                if defer_proof:
                    return sock, client_hello(sock, token, PURPOSE, f"the store at {peer}")
                client_handshake(sock, token, PURPOSE, f"the store at {peer}")
                return sock, None
            except AuthError:
                sock.close()
                raise
            except (DistNetworkError, OSError) as exc:
                sock.close()
                last = exc
        remaining = deadline - time.monotonic()
        if not retry or remaining <= 0:
            raise DistNetworkError(
                f"could not connect to the rankwise store at {peer} after trying for "
                f"{time.monotonic() - start:.1f}s ({attempts} attempts; last error: {last}). "
                f"Check that MASTER_ADDR/MASTER_PORT point at rank 0 or the launcher, that it "
                f"is running and listening there, and that no firewall blocks the port."
            ) from last
        time.sleep(min(delay, remaining))  # backoff between attempts, not synchronisation
        delay = min(delay * 2, 1.0)


#: requests this process sent to any store server (read by ``benchmarks/scale.py``)
_SENT = [0]
#: of those, the round trips: a batch (``Store.batch``) is one, however many it holds
_ROUNDS = [0]


def round_trips() -> int:
    """How many store round trips this process has waited for (a batch counts once)."""
    return _ROUNDS[0]


def requests_sent() -> int:
    """How many store requests this process has sent so far (all its TCPStore clients)."""
    return _SENT[0]


class TCPStore(Store):
    """A store served over TCP, API-compatible with ``torch.distributed.TCPStore``.

    With ``is_master=True`` this process also runs the server (a daemon thread bound to
    ``host_name``'s address only; ``port=0`` picks a free port, see ``.port``). With
    ``world_size`` every client counts itself in on connect, and a master with
    ``wait_for_workers=True`` blocks until ``world_size`` clients have joined.
    ``token`` (else ``RANKWISE_TOKEN``) must match on every side.
    ``prove_with_first_request``: the token's proof goes with the first request (a round
    trip less; a wrong token raises there, not here). Make that request soon: the server
    drops a handshake left unfinished for 30 s.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        wait_for_workers: bool = False,
        token: str | bytes | None = None,
        *,
        limits: Limits = DEFAULT_LIMITS,
        prove_with_first_request: bool = False,
    ) -> None:
        super().__init__(timeout, limits)
        if not isinstance(host_name, str) or not host_name:
            raise InvalidArgument(f"host_name must be a non-empty str, got {host_name!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be an int in 0..65535, got {port!r}")
        if port == 0 and not is_master:
            raise InvalidArgument("port 0 (pick a free port) only makes sense with is_master=True")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise InvalidArgument(f"world_size must be a positive int or None, got {world_size!r}")
        if token is not None and not isinstance(token, (str, bytes)):
            raise InvalidArgument(f"token must be str, bytes or None, got {type(token).__name__}")
        self._host = host_name
        self._world_size = world_size
        self._is_master = is_master
        self._token = resolve_token(token)
        self._lock = threading.Lock()
        self._watching_here = threading.local()  # the watcher of this thread's blocking call
        self._sock: socket.socket | None = None
        self._pending: PendingProof | None = None  #: the token proof the first request carries
        self._closed = False
        self._server: TCPStoreServer | None = None
        if is_master:
            self._server = TCPStoreServer(host_name, port, token, limits=limits).start()
            # A master dropped without close() must not keep the port served forever.
            weakref.finalize(self, self._server.close)
            port = self._server.port
        self._port = port
        self._connect_host = _LOCAL_FOR_WILDCARD.get(host_name, host_name)
        self._peer = f"{host_name}:{port}"
        try:
            self._sock, self._pending = open_store_socket(
                self._connect_host, port, self._token, self._timeout_s,
                defer_proof=prove_with_first_request)
            if world_size is not None:
                self._join(world_size, is_master and wait_for_workers)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ helpers
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one chosen when the master passed ``port=0``)."""
        return self._port

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def server(self) -> TCPStoreServer | None:
        """The server this process hosts (master only)."""
        return self._server

    def _describe(self) -> str:
        return f"TCPStore({self._peer})"

    def _join(self, world_size: int, wait_for_all: bool) -> None:
        """Count this client in; the last to arrive marks the group complete."""
        if self._add(_WORKERS_KEY, 1) == world_size:
            self._set(_WORKERS_DONE_KEY, b"1")
        if wait_for_all and self._wait([_WORKERS_DONE_KEY], self._timeout_s):
            joined = self._add(_WORKERS_KEY, 0)
            raise DistTimeout(
                f"only {joined} of {world_size} workers connected to the store at "
                f"{self._peer} within {self._timeout_s:g}s. Check that every rank was started "
                f"with the same MASTER_ADDR/MASTER_PORT and world size."
            )

    def _blocking(self, step: Callable[[float], bool], timeout_s: float) -> None:
        """A watched blocking call is one request the server parks for the whole timeout;
        the watcher is asked here, between looks at the socket, so a long wait costs one
        round trip, not one per ``WATCH_SLICE`` (requests grew with N x wait time)."""
        watch = self._watching()
        if watch is None:
            step(timeout_s)
            return
        self._watching_here.watch = watch
        try:
            step(timeout_s)
        except StoreError as err:
            watch(err)
            raise
        finally:
            self._watching_here.watch = None

    def _call(self, op: Op, fields: list[bytes], what: str, wait_s: float = 0.0) -> Response:
        """Send one request and read its reply, translating every failure.

        ``wait_s`` is how long the server may legitimately take (a blocking get/wait).
        """
        return self._exchange([(op, fields)], what, wait_s)[0]

    def _batch(self, ops: list[tuple[str, list[bytes]]]) -> list[bytes | int | None]:
        """Every request sent before the first reply is read: one round trip (the server
        answers a connection's requests in order)."""
        what = f"a batch of {len(ops)} requests"
        return self._results(ops, self._exchange(_requests(ops), what), what)

    def _batch_then_get(self, ops: list[tuple[str, list[bytes]]], key: bytes,
                        timeout_s: float) -> tuple[list[bytes | int | None], bytes | None]:
        """The batch and a blocking get in one write: the server answers the get once the
        key is set (or at ``timeout_s``), after the batch."""
        what = f"a batch of {len(ops)} requests and get({_show(key)})"
        responses = self._exchange(
            [*_requests(ops), (Op.GET, [key, encode_int(_ms(timeout_s))])], what, timeout_s)
        last = responses[-1]
        value = None if last.status is Status.TIMEOUT else self._one(last, what)
        return self._results(ops, responses[:-1], what), value

    def _batch_wait_read(self, ops: list[tuple[str, list[bytes]]], keys: list[bytes],
                         timeout_s: float) -> tuple[list[bytes | int | None], list[bytes],
                                                    list[bytes | None]]:
        """The batch, a blocking wait on ``keys`` and a read of each, in one write: the
        server answers the wait once every key is set (or at ``timeout_s``), then the reads,
        which see what the wait saw."""
        what = f"a batch of {len(ops)} requests, wait({len(keys)} keys) and their reads"
        reads = [(Op.COMPARE_SET, [key, _NEVER, _NEVER]) for key in keys]
        responses = self._exchange(
            [*_requests(ops), (Op.WAIT, [encode_int(_ms(timeout_s)), *keys]), *reads], what,
            timeout_s, block_at=len(ops))
        waited = responses[len(ops)]
        missing = list(waited.fields) if waited.status is Status.TIMEOUT else []
        values: list[bytes | None] = [] if missing else \
            [self._one(response, what) for response in responses[len(ops) + 1:]]
        return self._results(ops, responses[:len(ops)], what), missing, values

    def _results(self, ops: list[tuple[str, list[bytes]]], responses: list[Response],
                 what: str) -> list[bytes | int | None]:
        return [None if name == "set" else decode_int(self._one(response, what))
                if name == "add" else self._one(response, what)
                for (name, _), response in zip(ops, responses, strict=True)]

    def _exchange(self, requests: list[tuple[Op, list[bytes]]], what: str,
                  wait_s: float = 0.0, block_at: int = -1) -> list[Response]:
        """Send ``requests`` in one write and read their replies, translating failures.
        ``block_at``: the one request that may block (a get or wait; default the last),
        whose reply is awaited with the watcher asked meanwhile."""
        frame = b"".join(encode_request(op, fields, self._limits)  # before any I/O
                         for op, fields in requests)
        _SENT[0] += len(requests)
        _ROUNDS[0] += 1
        with self._lock:
            if self._closed:
                raise StoreError(f"{what} on a closed TCPStore ({self._peer})")
            if self._sock is None:
                self._sock = connect_store_socket(
                    self._connect_host, self._port, self._token, self._timeout_s, retry=False
                )
            sock = self._sock
            pending, self._pending = self._pending, None
            reply_s = max(wait_s, self._timeout_s) + _REPLY_GRACE_S
            try:
                sock.settimeout(reply_s)
                sock.sendall(frame if pending is None else pending.proof + frame)
                if pending is not None:  # the server proves itself before any reply is read
                    pending.finish(sock)
                # only one request may block (a get or wait after a batch)
                blocking = block_at % len(requests)
                responses = [read_response(sock, self._limits, self._peer)
                             for _ in requests[:blocking]]
                watch: Watcher | None = getattr(self._watching_here, "watch", None)
                if wait_s > 0 and watch is not None:
                    _await_reply(sock, reply_s, watch)
                responses += [read_response(sock, self._limits, self._peer)
                              for _ in requests[blocking:]]
            except _WatcherRaised as raised:
                self._drop()  # a reply is still due on this stream: reconnect on the next call
                raise raised.error from None
            except BaseException as exc:
                self._drop()  # the stream is out of sync now; reconnect on the next call
                if _dead_connection(exc):
                    raise StoreError(
                        f"the connection to the store at {self._peer} died during {what}: its "
                        f"host stopped answering TCP keepalive probes "
                        f"(RANKWISE_HEARTBEAT_TIMEOUT); likely a network partition, the host "
                        "down or a frozen process"
                    ) from exc
                if isinstance(exc, socket.timeout) or isinstance(exc.__cause__, socket.timeout):
                    raise DistTimeout(
                        f"store {what} at {self._peer}: no reply within {reply_s:g}s; the "
                        f"store server is stuck or unreachable"
                    ) from exc
                if isinstance(exc, (OSError, DistNetworkError, ProtocolError)):
                    raise StoreError(
                        f"lost the connection to the store at {self._peer} during {what}: "
                        f"{exc}. The process hosting the store (rank 0 or the launcher) may "
                        f"have exited."
                    ) from exc
                raise
            if any(response.status is Status.CLOSED for response in responses):
                self._drop()
                raise StoreError(
                    f"the store at {self._peer} went away during {what}: its server shut down"
                )
        for response in responses:
            if response.status is Status.ERROR:
                message = response.fields[0].decode("utf-8", "replace") if response.fields else ""
                raise StoreError(f"store at {self._peer} refused {what}: {message}")
        return responses

    def _drop(self) -> None:
        self._pending = None  # a proof owed on a closed connection: void
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @staticmethod
    def _one(response: Response, what: str) -> bytes:
        if len(response.fields) != 1:
            raise StoreError(f"malformed store reply to {what}: {len(response.fields)} fields")
        return response.fields[0]

    # --------------------------------------------------------------- primitives
    def _set(self, key: bytes, value: bytes) -> None:
        self._call(Op.SET, [key, value], f"set({_show(key)})")

    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        what = f"get({_show(key)})"
        response = self._call(Op.GET, [key, encode_int(_ms(timeout_s))], what, timeout_s)
        if response.status is Status.TIMEOUT:
            return None
        return self._one(response, what)

    def _add(self, key: bytes, amount: int) -> int:
        what = f"add({_show(key)})"
        return decode_int(self._one(self._call(Op.ADD, [key, encode_int(amount)], what), what))

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        what = f"compare_set({_show(key)})"
        return self._one(self._call(Op.COMPARE_SET, [key, expected, desired], what), what)

    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        response = self._call(
            Op.WAIT, [encode_int(_ms(timeout_s)), *keys], f"wait({len(keys)} keys)", timeout_s
        )
        return list(response.fields) if response.status is Status.TIMEOUT else []

    def _check(self, keys: list[bytes]) -> bool:
        return bool(decode_int(self._one(self._call(Op.CHECK, keys, "check"), "check")))

    def _delete_key(self, key: bytes) -> bool:
        what = f"delete_key({_show(key)})"
        return bool(decode_int(self._one(self._call(Op.DELETE, [key], what), what)))

    def _num_keys(self) -> int:
        return decode_int(self._one(self._call(Op.NUM_KEYS, [], "num_keys"), "num_keys"))

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the connection (waking a thread blocked in it); the master also stops
        its server, which wakes every other client's blocked waits with ``StoreError``."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()


def _await_reply(sock: socket.socket, reply_s: float, watch: Watcher) -> None:
    """Until the reply starts (or ``reply_s`` passes), ask ``watch`` every ``WATCH_SLICE``.
    A watcher that raises abandons the parked request: the caller drops the connection."""
    poller = select.poll()  # not select(): no FD_SETSIZE limit at thousands of ranks
    poller.register(sock, select.POLLIN)
    end = time.monotonic() + reply_s
    while not poller.poll(int(min(WATCH_SLICE, max(0.0, end - time.monotonic())) * 1000) + 1):
        if time.monotonic() >= end:
            raise TimeoutError(f"no reply within {reply_s:g}s")
        try:
            watch(None)
        except BaseException as exc:
            raise _WatcherRaised(exc) from exc


class _WatcherRaised(Exception):
    """Carries what the watcher raised past the translation of socket failures."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _dead_connection(exc: BaseException) -> bool:
    """The kernel gave up on the connection (keepalive or ``TCP_USER_TIMEOUT``): ETIMEDOUT,
    which Python also raises as ``TimeoutError``, unlike a socket timeout (no errno)."""
    return any(isinstance(e, OSError) and e.errno == errno.ETIMEDOUT
               for e in (exc, exc.__cause__))


def _requests(ops: list[tuple[str, list[bytes]]]) -> list[tuple[Op, list[bytes]]]:
    """``Store.batch``'s ops as wire requests."""
    codes = {"set": Op.SET, "add": Op.ADD, "compare_set": Op.COMPARE_SET}
    return [(codes[name], args if name != "add" else [args[0], encode_int(int(args[1]))])
            for name, args in ops]


def _show(key: bytes) -> str:
    return repr(key.decode("utf-8", "replace"))


def _ms(seconds: float) -> int:
    return int(min(seconds * 1000, INT64_MAX))
