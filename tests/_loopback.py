"""A connected pair of loopback TCP sockets, for tests that drive a transport by hand."""

from __future__ import annotations

import socket


def connected_pair() -> tuple[socket.socket, socket.socket]:
    """(accepted, connecting) ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        connecting = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return accepted, connecting
