"""TCP store specifics: auth, binding, connection errors, hostile clients, shutdown."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from rankwise.errors import (
    AuthError,
    DistError,
    DistNetworkError,
    DistTimeout,
    InvalidArgument,
    StoreError,
)
from rankwise.store import Limits, TCPStore, TCPStoreServer
from rankwise.store.protocol import Op, encode_request
from rankwise.wire.auth import client_handshake

pytestmark = pytest.mark.timeout(60)

T = timedelta(seconds=10)


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer("127.0.0.1", 0) as srv:
        yield srv


def _client(port: int, **kw: object) -> TCPStore:
    kw.setdefault("timeout", T)
    return TCPStore("127.0.0.1", port, **kw)  # type: ignore[arg-type]


def _raw(port: int, handshake: bool = True) -> socket.socket:
    """A bare socket to the store, authenticated (no token) unless told otherwise."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if handshake:
        client_handshake(sock, None, "store", "test server")
    return sock


def _assert_dropped(sock: socket.socket) -> None:
    """The server closed this connection (EOF or reset), rather than leaving it open."""
    sock.settimeout(5)
    try:
        assert sock.recv(1024) == b""
    except ConnectionResetError:
        pass
    finally:
        sock.close()


# ----------------------------------------------------------------- binding
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_server_binds_loopback_only(host: str) -> None:
    with TCPStoreServer(host, 0) as srv:
        addr, port = srv.address
        assert addr in ("127.0.0.1", "::1")
        assert port == srv.port != 0


def test_master_exposes_chosen_port_and_serves_itself() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=T) as master:
        assert master.server is not None and master.server.address[0] == "127.0.0.1"
        with _client(master.port) as c:
            c.set("k", "v")
            assert master.get("k") == b"v"


def test_port_in_use_says_what_to_change() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        with pytest.raises(DistNetworkError) as info:
            TCPStore("127.0.0.1", port, is_master=True, timeout=T)
        msg = str(info.value)
        assert "already in use" in msg and "MASTER_PORT" in msg and f"127.0.0.1:{port}" in msg
    finally:
        blocker.close()


def test_unreachable_master_times_out_with_advice() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    start = time.monotonic()
    with pytest.raises(DistNetworkError) as info:
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))
    elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 5
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "MASTER_ADDR" in msg and "firewall" in msg


def test_client_started_before_master_connects_once_it_listens() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    result: list[bytes] = []

    def early_worker() -> None:
        with TCPStore("127.0.0.1", port, timeout=T) as c:
            result.append(c.get("hello"))

    t = threading.Thread(target=early_worker, daemon=True)
    t.start()
    with TCPStore("127.0.0.1", port, is_master=True, timeout=T) as master:
        master.set("hello", "world")
        t.join(10)
    assert result == [b"world"]


def test_bad_constructor_arguments() -> None:
    with pytest.raises(InvalidArgument):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(InvalidArgument):
        TCPStore("127.0.0.1", 0)  # port 0 only for the master
    with pytest.raises(InvalidArgument):
        TCPStore("", 1234, is_master=True)
    with pytest.raises(InvalidArgument):
        TCPStore("127.0.0.1", 0, world_size=0, is_master=True)


# -------------------------------------------------------------------- auth
def test_matching_token_works_and_env_token_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    with TCPStoreServer("127.0.0.1", 0, token="s3cret") as srv:
        with _client(srv.port, token="s3cret") as c:
            c.set("k", "v")
        monkeypatch.setenv("RANKWISE_TOKEN", "s3cret")
        with _client(srv.port) as c:
            assert c.get("k") == b"v"


@pytest.mark.parametrize(
    ("server_token", "client_token"), [("right", "wrong"), ("right", None), (None, "extra")]
)
def test_token_mismatch_fails_fast(
    server_token: str | None, client_token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANKWISE_TOKEN", raising=False)
    with TCPStoreServer("127.0.0.1", 0, token=server_token) as srv:
        start = time.monotonic()
        with pytest.raises(AuthError, match="token"):
            TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=30), token=client_token)
        assert time.monotonic() - start < 3, "AuthError must not wait for the store timeout"
        with _client(srv.port, token=server_token) as good:  # the server keeps serving
            good.set("still", "serving")
            assert good.get("still") == b"serving"


# --------------------------------------------------------- hostile clients
def _malformed_frames() -> dict[str, bytes]:
    return {
        "random_bytes": os.urandom(64),
        "unknown_opcode": struct.pack("!BH", 99, 0),
        "oversized_length": struct.pack("!BHI", Op.SET, 2, 2**31),
        "too_many_keys": struct.pack("!BH", Op.CHECK, 60000),
        "wrong_field_count": struct.pack("!BH", Op.GET, 5),
        "bad_int_length": struct.pack("!BHI", Op.ADD, 2, 1) + b"k" + struct.pack("!I", 3) + b"abc",
    }


@pytest.mark.parametrize("name", sorted(_malformed_frames()))
def test_malformed_client_is_dropped_and_others_keep_working(
    server: TCPStoreServer, name: str
) -> None:
    with _client(server.port) as good:
        good.set("before", "1")
        bad = _raw(server.port)
        bad.sendall(_malformed_frames()[name])
        _assert_dropped(bad)
        assert good.get("before") == b"1"
        good.set("after", "2")
        assert good.get("after") == b"2"


def test_half_frame_then_close_and_garbage_handshake(server: TCPStoreServer) -> None:
    with _client(server.port) as good:
        half = _raw(server.port)
        half.sendall(encode_request(Op.SET, [b"key", b"value"])[:7])
        half.close()
        garbage = _raw(server.port, handshake=False)
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 64)
        _assert_dropped(garbage)
        good.set("k", "v")
        assert good.get("k") == b"v"


def test_half_frame_that_stalls_is_dropped_after_frame_timeout() -> None:
    with TCPStoreServer("127.0.0.1", 0, frame_timeout=0.3) as srv:
        stall = _raw(srv.port)
        stall.sendall(encode_request(Op.SET, [b"key", b"value"])[:7])
        _assert_dropped(stall)


def test_size_limits_client_and_server() -> None:
    small = Limits(max_key_bytes=8, max_value_bytes=32, max_keys=4)
    with TCPStoreServer("127.0.0.1", 0, limits=small) as srv:
        with _client(srv.port, limits=small) as c:
            with pytest.raises(InvalidArgument, match="limit"):
                c.set("k", b"x" * 33)
            with pytest.raises(InvalidArgument, match="limit"):
                c.set("k" * 9, "v")
            with pytest.raises(InvalidArgument, match="limit"):
                c.wait(["a", "b", "c", "d", "e"])
            c.set("k" * 8, b"x" * 32)
        with _client(srv.port) as loose:  # client allows more than this server
            with pytest.raises(StoreError, match=f"127.0.0.1:{srv.port}"):
                loose.set("k", b"x" * 33)
            loose.set("k", b"fits")  # reconnected after the server dropped it
            assert loose.get("k") == b"fits"
    with pytest.raises(InvalidArgument, match="67108864"):
        encode_request(Op.SET, [b"k", bytes(64 * 1024 * 1024 + 1)])


# ----------------------------------------------------- concurrency, shutdown
def test_blocked_get_does_not_block_other_clients(server: TCPStoreServer) -> None:
    clients = [_client(server.port) for _ in range(6)]
    try:
        results: dict[int, bytes] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, clients[i].get("gate")))
            for i in range(5)
        ]
        for t in threads:
            t.daemon = True
            t.start()
        setter = clients[5]
        start = time.monotonic()
        for i in range(20):  # served promptly while five gets are parked on the server
            setter.set(f"k{i}", str(i))
            assert setter.get(f"k{i}") == str(i).encode()
        assert time.monotonic() - start < 2
        setter.set("gate", "open")
        for t in threads:
            t.join(5)
        assert results == {i: b"open" for i in range(5)}
    finally:
        for c in clients:
            c.close()


def test_one_client_shared_by_threads(server: TCPStoreServer) -> None:
    with _client(server.port) as c:
        threads = [
            threading.Thread(target=lambda: [c.add("n", 1) for _ in range(100)], daemon=True)
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert c.get("n") == b"400"


def test_server_close_wakes_blocked_waiters() -> None:
    srv = TCPStoreServer("127.0.0.1", 0).start()
    caught: list[DistError] = []
    clients = [_client(srv.port, timeout=timedelta(seconds=30)) for _ in range(2)]

    def blocked(i: int) -> None:
        try:
            if i == 0:
                clients[0].get("never")
            else:
                clients[1].wait(["never", "either"])
        except DistError as exc:
            caught.append(exc)

    threads = [threading.Thread(target=blocked, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    # Parked on the server or not yet sent: either way each must end in StoreError.
    start = time.monotonic()
    srv.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - start < 5
    assert len(caught) == 2
    for exc in caught:
        assert isinstance(exc, StoreError), exc
        assert f"127.0.0.1:{srv.port}" in str(exc)
    for c in clients:
        c.close()


def test_closed_client_refuses_use(server: TCPStoreServer) -> None:
    c = _client(server.port)
    c.close()
    with pytest.raises(StoreError, match="closed"):
        c.set("k", "v")


def test_wait_for_workers() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    masters: list[TCPStore] = []
    t = threading.Thread(
        target=lambda: masters.append(
            TCPStore("127.0.0.1", port, 3, True, T, wait_for_workers=True)
        ),
        daemon=True,
    )
    t.start()
    workers = [TCPStore("127.0.0.1", port, 3, timeout=T) for _ in range(2)]
    t.join(10)
    assert len(masters) == 1
    assert masters[0].num_keys() == 0  # bookkeeping keys are not user keys
    for s in workers + masters:
        s.close()


def test_wait_for_workers_times_out_with_count() -> None:
    with pytest.raises(DistTimeout, match="only 1 of 2 workers"):
        TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=0.3), wait_for_workers=True)


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="needs TCP_USER_TIMEOUT")
def test_store_connections_get_keepalive_on_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store client whose server host is cut off (and the server, for a vanished client)
    errors out after ``2 * RANKWISE_HEARTBEAT_TIMEOUT`` instead of waiting on a dead
    connection: keepalive and TCP_USER_TIMEOUT are set on the client's socket and on the
    one the server accepted."""
    monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", "6")
    with TCPStoreServer("127.0.0.1", 0) as srv, _client(srv.port) as client:
        client.set("k", b"v")  # connected and served: the server holds the accepted socket
        assert client._sock is not None and srv._loop is not None
        accepted = [s for s in list(srv._loop._conns) if s.fileno() >= 0]
        assert len(accepted) == 1
        for sock in (client._sock, accepted[0]):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 6
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12000


def test_store_refuses_bad_heartbeat_timeout_before_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANKWISE_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(InvalidArgument, match="RANKWISE_HEARTBEAT_TIMEOUT"):
        TCPStoreServer("127.0.0.1", 0).start()
    with pytest.raises(InvalidArgument, match="RANKWISE_HEARTBEAT_TIMEOUT"):
        _client(1)


def test_connection_the_kernel_gave_up_on_is_named_as_such(
    server: TCPStoreServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ETIMEDOUT from keepalive/TCP_USER_TIMEOUT (Python raises it as TimeoutError) is a
    dead connection, not the request's own timeout: the error says the host stopped
    answering and names the likely causes."""
    import rankwise.store.tcp as tcp_module

    def dead(*args: object) -> None:
        raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")

    with _client(server.port) as client:
        client.set("k", b"v")
        monkeypatch.setattr(tcp_module, "read_response", dead)
        with pytest.raises(StoreError, match="stopped answering TCP keepalive.*partition"):
            client.get("k")
