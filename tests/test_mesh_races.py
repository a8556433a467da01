"""Init races of ``transport.mesh`` with their windows held open on purpose (no sleeps)."""

from __future__ import annotations

import socket
import threading
from typing import Any

from rankwise.store import HashStore
from rankwise.transport.mesh import Mesh


class _LateHandover(Mesh):
    """Rank 0 whose accept side hands a finished handshake over and then stays inside
    ``_handshake`` until ``connect()`` has returned: the window in which the old clean-up
    closed the just-handed-over socket (EBADF in ``TcpTransport.__init__``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.returned = threading.Event()

    def _accept_one(self, sock: socket.socket, addr: str, limit: float,
                    expected: set[int]) -> None:
        super()._accept_one(sock, addr, limit, expected)
        self.returned.wait(10)  # a bound, not a synchronisation: released by the test


def test_socket_handed_over_while_connect_returns_stays_open() -> None:
    store = HashStore()
    results: dict[int, Any] = {}
    mesh0 = _LateHandover(0, 2, store, b"job", None, "127.0.0.1", 20.0)

    def rank1() -> None:
        try:
            results[1] = Mesh(1, 2, store, b"job", None, "127.0.0.1", 20.0).connect()
        except BaseException as exc:  # noqa: BLE001
            results[1] = exc

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    try:
        results[0] = mesh0.connect()
    finally:
        mesh0.returned.set()
        t.join(20)
    assert not t.is_alive()
    assert isinstance(results[1], dict), results[1]
    a, b = results[0][1], results[1][0]
    try:
        assert a.fileno() != -1, "connect() closed the socket it returned"
        a.sendall(b"ping")
        assert b.recv(4) == b"ping"
    finally:
        a.close()
        b.close()



def test_out_of_descriptors_raises_at_once_naming_the_limit(monkeypatch: Any) -> None:
    """EMFILE is not "the peer is not listening yet": no retry until the init timeout."""
    import errno
    import resource

    from rankwise.errors import DistNetworkError
    from rankwise.transport import crowding

    def no_descriptor(*args: Any, **kw: Any) -> socket.socket:
        raise OSError(errno.EMFILE, "Too many open files")

    listener = socket.create_server(("127.0.0.1", 0))  # rank 0's (it never answers)
    blob = "\n".join(crowding.entry("127.0.0.1", listener.getsockname()[1]) for _ in range(2))
    mesh = Mesh(1, 2, HashStore(), b"job", None, "127.0.0.1", 600.0,
                listener=socket.create_server(("127.0.0.1", 0)), blob=blob)
    monkeypatch.setattr("rankwise.transport.mesh.socket.create_connection", no_descriptor)
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            mesh.connect()
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(20)  # before: retried every 50 ms until the 600 s timeout
    listener.close()
    assert not t.is_alive(), "EMFILE was retried"
    assert isinstance(outcome[0], DistNetworkError), outcome
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert "rank 1 could not connect to rank 0" in str(outcome[0])
    assert f"too many open files: RLIMIT_NOFILE is {soft}" in str(outcome[0])
