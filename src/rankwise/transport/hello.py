"""The hello that follows the token handshake on every data connection between ranks.

Why its own piece: the eager mesh (``mesh``) and the connections opened on demand
(``links``) must prove the same things the same way: the job (a digest of its rendezvous),
the rank and the world size, so that a stray or stale process (an earlier attempt of a
restarted job, another job on the same ports) is refused instead of silently joining.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from ..errors import AuthError, RendezvousError
from ..wire.auth import client_handshake, recv_exact, server_handshake

__all__ = ["PURPOSE", "Hello"]

PURPOSE = "mesh"  #: the handshake's purpose string (a store connection says another)
_HELLO = struct.Struct("<16sii")  # job digest, rank, world size


class Hello:
    """What ``rank`` of ``world_size`` says, and checks, on each of its connections."""

    def __init__(self, rank: int, world_size: int, job: bytes, token: bytes | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.job = job[:16].ljust(16, b"\0")
        self.token = token

    def mine(self) -> bytes:
        return _HELLO.pack(self.job, self.rank, self.world_size)

    def as_client(self, sock: socket.socket, peer: int, addr: str) -> None:
        """We connected to ``peer`` at ``addr``: prove ourselves, check that it is it."""
        client_handshake(sock, self.token, PURPOSE, f"rank {peer} at {addr}")
        sock.sendall(self.mine())
        self.check(recv_exact(sock, _HELLO.size, f"hello from rank {peer}"), peer)

    def as_server(self, sock: socket.socket, addr: str, allowed: Callable[[int], bool]) -> int:
        """A connection from ``addr`` arrived: check its token and hello; the rank it
        claims, or ``AuthError`` (after telling it so) when it is not one we expect. The
        caller answers with ``mine()`` once it has taken the connection."""
        server_handshake(sock, self.token, PURPOSE, f"connection from {addr}")
        job, peer, world = _HELLO.unpack(recv_exact(sock, _HELLO.size, f"hello from {addr}"))
        if job != self.job or world != self.world_size or not allowed(peer):
            sock.sendall(_HELLO.pack(b"\0" * 16, -1, -1))
            raise AuthError(f"refused {addr}: it belongs to another job or claims rank {peer}")
        return int(peer)

    def check(self, data: bytes, peer: int) -> None:
        job, rank, world = _HELLO.unpack(data)
        if rank == -1:
            raise RendezvousError(
                f"rank {peer} refused rank {self.rank}'s data connection: the processes "
                "disagree on the job (stale process from an earlier run, or a duplicate rank)")
        if job != self.job or rank != peer or world != self.world_size:
            raise RendezvousError(
                f"rank {self.rank} reached a process claiming rank {rank} of {world} at "
                f"rank {peer}'s address; it belongs to another job")
