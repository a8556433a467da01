"""Sending frames: headers filled from the call, call-site texts sent once per peer.

Why its own piece: every frame a rank sends goes through here, so the one rule of the
wire that spans frames (a call site's text precedes the first frame that names its id,
once per connection) and the one rule of failure (a broken send is explained by the
cause the reader noted, not by the broken pipe) each live in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DistError, DistNetworkError, PeerFailure
from ..identity.calls import Fingerprint
from ..identity.callsite import UNKNOWN, CallSite
from ..transport.base import audience
from ..wire.frames import Kind, encode_header

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Sender"]


class Sender:
    """Frames from this rank to global ranks, over the communicator's transport."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._sites_sent: dict[int, set[int]] = {r: set() for r in range(comm.world_size)}

    def send(self, dst: int, kind: int, payload: memoryview | bytes | None, deadline: float,
             *, group: int = 0, seq: int = 0, fp: Fingerprint | None = None,
             site: CallSite = UNKNOWN, step: int = 0, tag: int = 0) -> None:
        """Send one frame to global rank ``dst`` (site text first if new there)."""
        if site.id and site.id not in self._sites_sent[dst]:
            self._send_site(dst, site, deadline)
        n = 0 if payload is None else memoryview(payload).nbytes
        if fp is None:
            header = encode_header(kind, group=group, seq=seq, site=site.id, step=step,
                                   tag=tag, payload_len=n)
        else:
            header = encode_header(kind, group, seq, fp.op, fp.dtype, fp.reduce, fp.flags,
                                   fp.root, fp.count, tag, site.id, step, n)
        self._send_raw(dst, header, payload, deadline)

    def send_frame(self, dst: int, header: bytes, payload: memoryview | None, deadline: float,
                   site: CallSite) -> None:
        """Send a frame whose header the caller packed (a collective's, see ``OpLink``)."""
        if site.id and site.id not in self._sites_sent[dst]:
            self._send_site(dst, site, deadline)
        self._send_raw(dst, header, payload, deadline)

    def tell_everyone(self, kind: Kind, payload: bytes, deadline: float) -> None:
        """One control frame to every live peer (or, with connections opened on demand, to
        the transport's ``audience``, who pass failures on); a peer we cannot reach is
        skipped (this runs while failing or leaving, when nothing better can be done)."""
        comm = self._comm
        header = encode_header(kind, payload_len=len(payload))
        for peer in audience(comm.transport):
            if not comm.router.peer_gone(peer):
                try:
                    comm.transport.send(peer, header, payload, deadline)
                except DistError:
                    pass

    def _send_site(self, dst: int, site: CallSite, deadline: float) -> None:
        """Define ``site.id`` for ``dst`` (once per connection) before a frame names it."""
        self._sites_sent[dst].add(site.id)
        text = site.encode().encode()
        self._send_raw(dst, encode_header(Kind.SITE, site=site.id, payload_len=len(text)),
                       text, deadline)

    def _send_raw(self, dst: int, header: bytes, payload: memoryview | bytes | None,
                  deadline: float) -> None:
        comm = self._comm
        try:
            comm.transport.send(dst, header, payload, deadline)
        except DistNetworkError as exc:
            comm.transport.drive_end()  # if this thread was the reader, let another read
            failure = comm.router.wait_for_cause(dst, 1.0)
            if failure is not None:  # the cause explains it; the broken pipe adds nothing
                raise comm.as_of_now(failure) from None
            raise PeerFailure(f"rank {comm.rank} lost its connection to rank {dst} while "
                              f"sending: {exc}", rank=dst) from exc
