"""User point-to-point messages: send/recv/isend/irecv/batch_isend_irecv.

These travel as ``Kind.P2P`` frames, matched by (source, tag) in arrival order, in a
namespace of their own: they can never be confused with collective traffic (matched by
group and sequence number) or with the library's own object messages (``Kind.OBJ``).
A send returns once the network has the data; receivers always drain their sockets,
so a send never waits for the matching recv to be posted and cannot deadlock on it.
CUDA tensors of a group with an NCCL plane go over NCCL, announced and checked by a
header on the control plane (``api.p2p_nccl``, ``engines.torch.p2p``; the same (source,
tag) rule); elsewhere (gloo, staged, ``RANKWISE_NCCL_P2P=0``) they travel through host
memory (a receive lands in a host copy, copied into the tensor when it completes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.communicator import Activity
from ..core.group import ProcessGroup
from ..core.router import Pending
from ..core.work import Work, completed_work
from ..errors import DistError, InvalidArgument
from ..identity.calls import Fingerprint
from ..identity.callsite import CallSite, capture
from ..wire.buffers import Buffer, as_buffer, commit, dtype_name, on_host
from ..wire.frames import Kind, Op
from . import p2p_nccl, profiling
from .p2p_nccl import DeviceRecvWork, device_p2p, p2p_call
from .world import resolve_group

if TYPE_CHECKING:
    from ..engines.torch.device_waits import OrderedWork

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _check_tag(tag: Any) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not -(1 << 62) < tag < (1 << 62):
        raise InvalidArgument(f"tag must be an int, got {tag!r}")
    return tag


def _peer(g: ProcessGroup, peer: int | None, group_peer: int | None, name: str,
          allow_any: bool = False) -> int:
    """The global rank of ``peer`` (-1: any source), validated against the group."""
    if peer is not None and group_peer is not None:
        raise InvalidArgument(f"pass {name} or group_{name}, not both")
    if group_peer is not None:
        if not isinstance(group_peer, int) or not 0 <= group_peer < g.size():
            raise InvalidArgument(f"group_{name}={group_peer!r} is not in 0..{g.size() - 1}")
        peer = g.ranks[group_peer]
    if peer is None:
        if allow_any:
            return -1
        raise InvalidArgument(f"{name} is required")
    g.group_rank_of(peer, name)
    if peer == g.comm.rank:
        raise InvalidArgument(f"rank {peer} cannot {'send to' if name == 'dst' else 'receive from'}"
                              " itself: a blocking self-message would never complete")
    return peer


def _do_send(g: ProcessGroup, buf: Buffer, dst: int, tag: int) -> None:
    fp = Fingerprint(int(Op.send), buf.dtype.code, 0, 0, 0, buf.numel)
    comm = g.comm
    comm.router.check_alive([dst])
    payload = buf.array.view("uint8").data if buf.nbytes else None
    comm.send(dst, Kind.P2P, payload, time.monotonic() + g.timeout, group=g.id, fp=fp,
              site=capture(), tag=tag)


def _post_recv(g: ProcessGroup, buf: Buffer, src: int, tag: int) -> Pending:
    return g.comm.router.post_p2p(Kind.P2P, g.id, src, tag, buf.array.view("uint8").data)


def _finish_recv(g: ProcessGroup, pending: Pending, buf: Buffer, src: int, tag: int,
                 timeout: float | None = None) -> int:
    who = "any rank" if src == -1 else f"rank {src}"
    site = capture()
    comm = g.comm
    started = time.time()
    limit = g.timeout if timeout is None else timeout  # the one the error then names
    frame = _in_recv(g, src, tag, lambda: comm.wait(
        pending, time.monotonic() + limit,
        lambda: f"rank {comm.rank} timed out after {limit:g}s in recv from {who} "
                f"(tag {tag}) at {site.short}: no matching send arrived",
    ), site)
    if comm.tracer is not None:
        comm.tracer.recv(started, time.time(), frame.src, buf.nbytes, tag, site)
    if frame.dtype != buf.dtype.code:
        raise DistError(f"recv at {site.short} expected {buf.dtype.name} but rank {frame.src} "
                        f"sent {dtype_name(frame.dtype)} (tag {tag})")
    commit(buf)  # a CUDA tensor received through host memory
    return frame.src


_T = TypeVar("_T")


def _in_recv(g: ProcessGroup, src: int, tag: int, wait: Callable[[], _T],
             site: CallSite | None = None) -> _T:
    """``wait()`` shown as this rank's activity: who-is-where reports show the wait,
    and p2p cycles are found from it."""
    comm = g.comm
    previous = comm.activity
    comm.activity = Activity("recv", g.id, 0, site or capture(), time.time(), src,
                             kind="recv", tag=tag)
    try:
        return wait()
    finally:
        comm.activity = previous if previous.op else Activity(since=time.time())


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    _send(g, tensor, dst, tag, group_dst, wait=True)


def _send(g: ProcessGroup, tensor: Any, dst: int | None, tag: int, group_dst: int | None,
          wait: bool) -> OrderedWork | None:
    """Send on NCCL (the device part of the ``Work``; ``wait``: the current stream is
    ordered after it, as torch's ``send``) or through host memory (None)."""
    buf = as_buffer(tensor, "tensor")
    peer, tag = _peer(g, dst, group_dst, "dst"), _check_tag(tag)
    nccl = device_p2p(g, buf)
    if nccl is None:
        buf = on_host(buf)  # CUDA tensors travel through host memory
    ev = profiling.Event("send", [tensor]) if profiling.on() else None
    try:
        if nccl is None:
            _do_send(g, buf, peer, tag)
            return None
        site = capture()
        call = p2p_call(g, Op.send, buf, site)
        p = nccl.send(call, buf.array, peer, tag, site.short, buf.shape)
        if wait:
            nccl.waits.order(call, p)
        from ..engines.torch.device_waits import OrderedWork

        return OrderedWork(nccl.waits, call, [p])
    finally:
        if ev is not None:
            ev.end()


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor``; returns the sender's global rank (any source if None)."""
    g = resolve_group(group)
    if g is None:
        return -1
    buf = as_buffer(tensor, "tensor", writable=True)
    peer = _peer(g, src, group_src, "src", allow_any=True)
    tag = _check_tag(tag)
    nccl = device_p2p(g, buf)
    g.comm.router.check_alive()
    ev = _recv_event(tensor, peer)
    try:
        if nccl is not None:
            r = nccl.post(p2p_call(g, Op.recv, buf, capture()), buf.array, peer, tag)
            return p2p_nccl.finish(g, nccl, r, shown=lambda wait: _in_recv(g, peer, tag, wait))
        buf = on_host(buf, copy=False)
        return _finish_recv(g, _post_recv(g, buf, peer, tag), buf, peer, tag)
    finally:
        if ev is not None:
            ev.end()


def _recv_event(tensor: Any, src: int) -> profiling.Event | None:
    """gloo's names: ``recv`` from one rank, ``recvAnySource`` from any."""
    if not profiling.on():
        return None
    return profiling.Event("recvAnySource" if src == -1 else "recv", [tensor])


class _RecvWork(Work):
    """An irecv: completes when the message lands; no thread involved."""

    def __init__(self, g: ProcessGroup, pending: Pending, buf: Buffer, src: int, tag: int,
                 ev: profiling.Event | None = None):
        super().__init__(f"irecv from {'any' if src == -1 else src} tag {tag}")
        self._g, self._pending, self._buf, self._src, self._tag = g, pending, buf, src, tag
        self._sender = -1
        self._ev = ev  #: the profiler event, ended when the receive is

    def wait(self, timeout: Any = None) -> bool:
        if not self._done.is_set():
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            try:
                self._sender = _finish_recv(self._g, self._pending, self._buf, self._src,
                                            self._tag, seconds)
            except BaseException as exc:
                self._finish(exc)
                raise
            finally:
                if self._ev is not None:
                    self._ev.end()
            self._finish()
        return super().wait()

    def is_completed(self) -> bool:
        return self._done.is_set() or self._pending.completed

    def source_rank(self) -> int:
        self.wait()
        return self._sender

    _source_rank = source_rank


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Send; the returned Work is already complete (the data is in the network)."""
    g = resolve_group(group)
    if g is None:
        return None
    device = _send(g, tensor, dst, tag, group_dst, wait=False)
    if device is None:
        return completed_work(f"isend to {dst} tag {tag}")
    work = Work(f"isend to {dst} tag {tag}", device=device)
    work._finish()  # enqueued: ``wait`` orders the stream, ``is_completed`` asks NCCL
    return work


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    peer = _peer(g, src, group_src, "src", allow_any=True)
    tag = _check_tag(tag)
    nccl = device_p2p(g, buf)
    g.comm.router.check_alive()
    if nccl is not None:
        r = nccl.post(p2p_call(g, Op.recv, buf, capture()), buf.array, peer, tag)
        return DeviceRecvWork(g, nccl, r, f"irecv from {'any' if peer == -1 else peer} tag {tag}",
                              lambda wait: _in_recv(g, peer, tag, wait))
    buf = on_host(buf, copy=False)
    ev = _recv_event(tensor, peer)
    return _RecvWork(g, _post_recv(g, buf, peer, tag), buf, peer, tag, ev)


class P2POp:
    """One entry of ``batch_isend_irecv``: ``P2POp(rankwise.isend, tensor, peer)``."""

    def __init__(self, op: Callable[..., Any], tensor: Any, peer: int | None = None,
                 group: Any = None, tag: int = 0, group_peer: int | None = None) -> None:
        if op not in (isend, irecv) and getattr(op, "__name__", "") not in ("isend", "irecv"):
            raise InvalidArgument("P2POp's op must be rankwise.isend or rankwise.irecv")
        self.op = isend if getattr(op, "__name__", "") == "isend" else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every receive first, then send: any order of ops across ranks completes."""
    if not isinstance(p2p_op_list, (list, tuple)) or not all(
            isinstance(p, P2POp) for p in p2p_op_list):
        raise InvalidArgument("batch_isend_irecv takes a list of P2POp")
    # validate everything before any I/O
    for p in p2p_op_list:
        g = resolve_group(p.group)
        if g is not None:
            buf = as_buffer(p.tensor, "P2POp.tensor", writable=p.op is irecv)
            _peer(g, p.peer, p.group_peer, "src" if p.op is irecv else "dst")
            _check_tag(p.tag)
            nccl = device_p2p(g, buf)
            if nccl is not None:  # a tensor off the group's GPU
                nccl.check(p2p_call(g, Op.recv if p.op is irecv else Op.send, buf,
                                    capture()), buf.array)
    works: dict[int, Work] = {}
    for i, p in enumerate(p2p_op_list):
        if p.op is irecv:
            w = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
            if w is not None:
                works[i] = w
    for i, p in enumerate(p2p_op_list):
        if p.op is isend:
            w = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
            if w is not None:
                works[i] = w
    return [works[i] for i in sorted(works)]
