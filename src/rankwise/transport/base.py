"""The seam between moving frames and deciding what they mean.

A transport moves framed messages between the ranks of one job; everything above it
(matching, fingerprint checks, algorithms) is written against these two small
interfaces, so the collectives can be tested without sockets (see ``memory.py``).
"""

from __future__ import annotations

from typing import Protocol

from ..errors import DistError
from ..wire.frames import Frame

__all__ = ["FrameHandler", "NoDriving", "Transport", "audience", "passes_on", "watch"]


class FrameHandler(Protocol):
    """What a transport calls as frames arrive (from its own I/O thread)."""

    def on_header(self, frame: Frame) -> tuple[memoryview | bytearray | None, object]:
        """Return where to put the payload (exactly ``frame.payload_len`` bytes) and a
        token handed back to ``on_payload``; or ``(None, DROP)``: read the payload and
        drop it; or ``(None, HOLD)``: no room now, stop reading this peer until
        ``Transport.resume(frame.src)``, then offer the same frame again."""

    def on_payload(self, frame: Frame, token: object) -> None:
        """The payload announced by ``frame`` is complete."""

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        """The connection to ``rank`` ended: ``reason`` is None for a clean close."""

    def on_fatal(self, exc: DistError) -> None:
        """The transport's reader failed unexpectedly (``exc`` says how): nothing more
        will be delivered reliably."""


class Transport(Protocol):
    """Framed, ordered, reliable delivery to every other rank of the job."""

    rank: int
    world_size: int

    def send(self, dst: int, header: bytes, payload: memoryview | bytes | None,
             deadline: float) -> None:
        """Hand one frame to the network; returns when the kernel has it all.

        Raises ``DistTimeout`` past ``deadline`` (time.monotonic) and
        ``DistNetworkError`` when the connection is broken.
        """

    def start(self, handler: FrameHandler) -> None:
        """Begin delivering arriving frames to ``handler``."""

    def resume(self, rank: int) -> None:
        """Read ``rank`` again after the handler answered one of its frames ``HOLD``."""

    def drive_begin(self) -> bool:
        """Let the calling thread read arriving frames itself (``progress``) instead of
        the transport's I/O thread; False when another thread drives already."""

    def drive_end(self) -> None:
        """Hand reading back to the I/O thread (no-op unless this thread drives)."""

    def driving(self) -> bool:
        """True when the calling thread is the one reading."""

    def progress(self, timeout: float) -> None:
        """Driver only: wait up to ``timeout`` seconds for frames and deliver them."""

    def close(self) -> None:
        """Close every connection; pending sends fail, the I/O thread ends."""


def audience(transport: Transport) -> list[int]:
    """The peers a frame meant for every rank (an abort, a goodbye) goes to: all of them,
    unless the transport opens connections on demand (``TcpTransport.audience``)."""
    narrow = getattr(transport, "audience", None)
    if narrow is not None:
        return list(narrow())
    return [p for p in range(transport.world_size) if p != transport.rank]


def passes_on(transport: Transport) -> bool:
    """Whether a rank that learns of a failure must pass it on to its ``audience``: only
    when that audience is not every rank (``TcpTransport.passes_on``)."""
    check = getattr(transport, "passes_on", None)
    return bool(check()) if check is not None else False


def watch(transport: Transport, peer: int) -> None:
    """This rank has waited a while on ``peer``: a transport that opens connections on
    demand makes sure it would hear of the peer's end (``OnDemand.watch``)."""
    check = getattr(transport, "watch", None)
    if check is not None and peer >= 0:
        check(peer)


class NoDriving:
    """For transports whose frames are always delivered by their own thread: the caller
    never reads for itself (``drive_begin`` is always False), so it just waits."""

    def drive_begin(self) -> bool:
        return False

    def drive_end(self) -> None:
        return None

    def driving(self) -> bool:
        return False

    def progress(self, timeout: float) -> None:
        raise RuntimeError(f"{type(self).__name__} has no driver: drive_begin() is always "
                           "False")
