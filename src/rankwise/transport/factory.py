"""Which transport reaches which peer: shared memory on this host, TCP to the others.

Why per peer: a job spread over hosts still has ranks that share one, and those should
not pay for loopback TCP; the ranks elsewhere can only be reached over the network. Each
rank publishes its host identity (``engines.select.host_identity``: hostname, boot id,
/dev/shm device, pid namespace, architecture — never ``LOCAL_WORLD_SIZE``) and the ranks
with an identity equal to ours share one ring segment. Setting that up either works on
every rank of the host or fails on all of them alike (``segment.open_segment`` agrees
on the outcome), so both ends of every pair always pick the same transport.

``RANKWISE_TRANSPORT`` = ``tcp`` (default: TCP to every peer), ``shm`` (shared memory to
every peer, or an error saying why not), ``auto`` (shared memory on this host when it
works, else TCP with one log line saying why; TCP between hosts).

``RANKWISE_CONNECT`` = ``eager`` (a full mesh at init), ``lazy`` (each connection opened
when first needed, ``links``) or ``auto`` (default: eager below ``LAZY_FROM`` ranks, where
the mesh costs little and the first calls pay no handshakes; lazy from there). Only the
``tcp`` transport connects lazily; ``shm``/``auto`` keep the mesh to their remote peers.
"""

from __future__ import annotations

import logging
import socket
from typing import Protocol

from .. import settings
from ..errors import DistError, DistNetworkError
from ..shmem.errors import ShmUnavailable
from ..shmem.host import host_identity
from ..shmem.segment import StoreLike
from .base import Transport
from .links import Links
from .mesh import Mesh
from .per_peer import PerPeerTransport
from .tcp import TcpTransport

__all__ = ["CONNECT_ENV", "LAZY_FROM", "TRANSPORTS", "TRANSPORT_ENV", "connects_lazily",
           "open_transport", "requested_transport"]

log = logging.getLogger("rankwise")

TRANSPORT_ENV = "RANKWISE_TRANSPORT"
TRANSPORTS = settings.choices(TRANSPORT_ENV)
CONNECT_ENV = "RANKWISE_CONNECT"
CONNECTS = settings.choices(CONNECT_ENV)
#: from this many ranks on, connections are opened on demand (docs/scale.md, "Connections")
LAZY_FROM = 32


class _Store(StoreLike, Protocol):
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: float | None = None) -> None: ...


def requested_transport() -> str:
    """The transport the environment asks for, validated before any I/O."""
    value = settings.choice(TRANSPORT_ENV)
    connects_lazily(2)  # a bad RANKWISE_CONNECT is refused before any I/O too
    return value


def connects_lazily(world_size: int) -> bool:
    """Whether a tcp job of ``world_size`` ranks opens its connections on demand."""
    value = settings.choice(CONNECT_ENV)
    return value == "lazy" or (value == "auto" and world_size >= LAZY_FROM)


def _all_have_read(store: _Store, world_size: int, timeout: float) -> None:
    """Before every rank fails alike: wait (bounded) until all have read the hosts, so
    the rank hosting the store does not exit under a rank still reading them (which
    would then fail with "connection closed" instead of the reason)."""
    if int(store.add("mesh/host/read", 1)) >= world_size:
        store.set("mesh/host/all-read", "1")
    try:
        store.wait(["mesh/host/all-read"], timeout)
    except DistError:
        pass  # a rank that never reads: fail with the reason anyway


def open_transport(rank: int, world_size: int, store: _Store, job: bytes,
                   token: bytes | None, bind_host: str, timeout: float,
                   listener: socket.socket | None = None, blob: str | None = None) -> Transport:
    """Connect ``rank`` to every other rank of the job, each by the transport that
    suits it. Collective: every rank calls it with the same ``RANKWISE_TRANSPORT``.
    ``listener``/``blob``: published and gathered in the rendezvous (``Mesh``)."""
    want = requested_transport()
    mesh = Mesh(rank, world_size, store, job, token, bind_host, timeout, listener, blob)
    if want == "tcp" and world_size > 1 and connects_lazily(world_size):
        listener, addrs = mesh.publish()
        lazy = TcpTransport(rank, world_size, {},
                            links=Links(mesh.hello, listener, addrs, store))
        lazy.crowded = mesh.crowded
        return lazy
    if want == "tcp" or world_size == 1:
        # only here does every rank read the whole address blob: ``crowded`` is agreed
        eager = TcpTransport(rank, world_size, mesh.connect())
        eager.crowded = mesh.crowded
        return eager
    hosts = mesh.exchange("host", host_identity())
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    if want == "shm" and len(local) < world_size:
        _all_have_read(store, world_size, min(timeout, 5.0))
        apart = sorted({h.split("|", 1)[0] for h in hosts})
        raise DistNetworkError(
            f"{TRANSPORT_ENV}=shm, but the ranks do not share one host (hosts {apart}, or "
            f"different containers/boots); use {TRANSPORT_ENV}=auto for tcp between hosts")
    shm: Transport | None = None
    if len(local) > 1:
        from .shm import ShmTransport  # only same-host ranks need it

        try:
            shm = ShmTransport.open(store, f"mesh/shm/{local[0]}", rank, world_size, local,
                                    timeout)
        except ShmUnavailable as exc:
            if want == "shm":
                raise
            if rank == local[0]:
                log.warning("rankwise: ranks %s talk over tcp, not shared memory: %s",
                            local, exc)
    near = set(local) - {rank} if shm is not None else set()
    far = set(range(world_size)) - {rank} - near
    tcp = TcpTransport(rank, world_size, mesh.connect(far)) if far else None
    if tcp is None:
        assert shm is not None
        return shm
    if shm is None:
        return tcp
    route: dict[int, Transport] = {p: shm for p in near}
    route.update({p: tcp for p in far})
    return PerPeerTransport(rank, world_size, route, [shm, tcp])
