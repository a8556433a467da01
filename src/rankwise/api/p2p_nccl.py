"""The CUDA half of ``api.p2p``: tensors of a group with an NCCL plane go over NCCL.

Why here: the API decides per call which plane a p2p message takes (the device
engine's NCCL, or host memory as ``Kind.P2P`` frames), and only the API reaches the
control plane's router for the headers (``ControlLink``); the matching and the NCCL
side are ``engines.torch.p2p``'s, built by the engine (``TorchEngine.make_p2p``).
``RANKWISE_NCCL_P2P``: ``0`` sends CUDA tensors through host memory as before, ``1``
takes NCCL (also on the CPU stand-in of the tests), unset: NCCL where the group's device
engine is NCCL itself. Every rank of a job must take the same plane for a message (the
switch is read per process: set it for the whole job).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import settings
from ..core.work import Work
from ..errors import DistTimeout
from ..identity.calls import Fingerprint
from ..identity.callsite import CallSite
from ..wire.frames import Kind, Op

if TYPE_CHECKING:
    from ..core.group import ProcessGroup
    from ..core.router import Pending
    from ..engines.base import Call
    from ..engines.device.p2p_book import Receive
    from ..engines.torch.p2p import NcclP2P
    from ..wire.buffers import Buffer

__all__ = ["ENV", "HEADER_TAG", "ControlLink", "DeviceRecvWork", "device_p2p", "finish",
           "p2p_call"]

ENV = "RANKWISE_NCCL_P2P"
#: the headers' tag: outside the users' range (``api.p2p._check_tag``), so a header never
#: matches a user's receive of host messages
HEADER_TAG = 1 << 62
_made = threading.Lock()


def _call(fn: Callable[[], None]) -> None:
    fn()


def enabled(engine_name: str) -> bool:
    """The switch (validated before any I/O): see the module's doc."""
    raw = settings.choice(ENV)
    return raw == "1" or (raw == "" and engine_name == "nccl")


def device_p2p(g: ProcessGroup, buf: Buffer) -> NcclP2P | None:
    """The group's device p2p for ``buf``, None where it goes through host memory: host
    buffers, groups without an NCCL plane (gloo, staged), or the switch off."""
    from ..engines.device.pair import DevicePair

    engine = g.engine
    if not buf.dtype.tensor or not isinstance(engine, DevicePair):
        return None
    device: Any = engine.device
    if getattr(device, "device", None) is None or not enabled(device.name):
        return None
    p2p: NcclP2P | None = device.p2p
    if p2p is None:
        with _made:
            p2p = device.p2p
            if p2p is None:
                p2p = device.p2p = _make(g, device)
    return p2p


def _make(g: ProcessGroup, engine: Any) -> NcclP2P:
    """The device engine's p2p (``TorchEngine.make_p2p``), given what only the control
    plane has: the headers' link and the way a mismatch reaches every rank."""
    comm = g.comm

    def tell(exc: BaseException) -> None:
        comm.tell_mismatch(str(exc))
        comm.router.fail_all(exc)

    p2p: NcclP2P = engine.make_p2p(ControlLink(g), tell)
    return p2p


def p2p_call(g: ProcessGroup, op: Op, buf: Buffer, site: CallSite,
             timeout: float | None = None) -> Call:
    """The call a device p2p op is watched as (never registered: p2p has no sequence)."""
    from ..engines.base import Call

    fp = Fingerprint(int(op), buf.dtype.code, 0, 0, 0, buf.numel)
    return Call(g, 0, fp, site, buf.dtype, None,
                time.monotonic() + (g.timeout if timeout is None else timeout),
                time.time(), buf.shape, label=op.name)


class ControlLink:
    """Headers over rankwise's control plane: ``Kind.P2P`` frames of the group with the
    tag ``HEADER_TAG``, read one at a time in arrival order (one receive posted)."""

    def __init__(self, g: ProcessGroup) -> None:
        self._comm = g.comm
        self._gid = g.id
        self._posted: Pending | None = None

    def send(self, dst: int, payload: bytes, deadline: float) -> None:
        self._comm.router.check_alive([dst])
        self._comm.send(dst, Kind.P2P, payload, deadline, group=self._gid, tag=HEADER_TAG)

    def next(self, timeout: float) -> tuple[int, bytes] | None:
        p = self._posted
        if p is None:
            p = self._posted = self._comm.router.post_p2p(Kind.P2P, self._gid, -1,
                                                          HEADER_TAG, None)
        if not p.completed:
            if timeout <= 0:
                return None
            try:
                p.wait(time.monotonic() + timeout, str)
            except DistTimeout:
                if not p.completed:
                    return None
                raise
        self._posted = None
        frame = p.wait(0.0, str)  # done: its error, if any
        return frame.src, bytes(p.buffer or b"")

    def failure(self) -> BaseException | None:
        port = self._comm.port
        if port.failure is None:
            return None
        try:
            port.raise_failure()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            return exc
        return None

    def gone(self, rank: int) -> BaseException | None:
        return self._comm.router.peer_gone(rank)


def finish(g: ProcessGroup, p2p: NcclP2P, r: Receive, timeout: float | None = None,
           shown: Callable[[Callable[[], None]], None] = _call) -> int:
    """``p2p.finish``, bounded as the host path's (the group's timeout from now: an
    ``irecv`` waited for long after it was posted is not past its deadline at once), a
    timeout with the who-is-where table. ``shown(wait)`` runs the wait for the peer's
    send (who-is-where shows it); ordering after the data is not such a wait."""
    try:
        shown(lambda: p2p.match(r, g.timeout if timeout is None else timeout))
        return p2p.complete(r)
    except DistTimeout as exc:
        comm = g.comm
        if exc.report or comm.router.failure is not None:
            raise
        table = comm.mismatches.check_where(f"rank {comm.rank} timed out in a recv on nccl")
        failure = comm.router.failure
        if failure is not None:  # the table found a mismatch no message revealed
            raise failure from None
        raise DistTimeout(str(exc), report=table) from None


class DeviceRecvWork(Work):
    """An ``irecv`` on NCCL: matched when its header is read (``is_completed`` and
    ``wait`` read what is there), then ordered like any NCCL work."""

    def __init__(self, g: ProcessGroup, p2p: NcclP2P, r: Receive, description: str,
                 shown: Callable[[Callable[[], None]], None] = _call) -> None:
        super().__init__(description)
        self._g, self._p2p, self._r, self._shown = g, p2p, r, shown
        self._sender = -1

    def wait(self, timeout: Any = None) -> bool:
        if not self._done.is_set():
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            try:
                self._sender = finish(self._g, self._p2p, self._r, seconds, self._shown)
            except BaseException as exc:
                self._finish(exc)
                raise
            self._finish()
        return super().wait()

    def is_completed(self) -> bool:
        return self._done.is_set() or self._p2p.done(self._r)

    def source_rank(self) -> int:
        self.wait()
        return self._sender

    _source_rank = source_rank
