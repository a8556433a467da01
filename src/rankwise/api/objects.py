"""Object collectives (``all_gather_object`` ...) on top of the tensor collectives.

Objects are encoded by the safe serializer (``wire.serialize``), never pickled unless every
rank opted in. Sizes are exchanged first, then the bytes, padded to the largest, through
the same fingerprinted collectives as tensors, so a rank that calls the wrong object
collective is caught like any other mismatch. ``send_object_list``/``recv_object_list``
use ``Kind.OBJ`` frames, a namespace user ``recv`` never matches.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.group import ProcessGroup
from ..errors import CollectiveMismatch, InvalidArgument
from ..identity.callsite import capture
from ..wire.buffers import as_buffer
from ..wire.frames import Kind, Op
from ..wire.serialize import dumps, loads, pickle_allowed
from .collectives import _root
from .p2p import _peer
from .path import launch
from .world import resolve_group

__all__ = [
    "all_gather_object", "broadcast_object_list", "gather_object", "recv_object_list",
    "scatter_object_list", "send_object_list",
]

_U8 = as_buffer(np.zeros(1, np.uint8), "bytes").dtype
_I64 = as_buffer(np.zeros(1, np.int64), "sizes").dtype


def _require_list(x: Any, name: str) -> None:
    """torch fills object lists in place, so they must be real lists."""
    if not isinstance(x, list):
        raise InvalidArgument(f"{name} must be a list, got {type(x).__name__}")


def _gather_sizes(g: ProcessGroup, size: int) -> list[int]:
    """Every rank learns every rank's payload size (one small all-gather)."""
    slots = [np.zeros(1, np.int64) for _ in range(g.size())]
    slots[g.group_rank][0] = size
    launch(g, Op.object_sizes, _I64, 1, None, 0, lambda engine, call: engine.all_gather(call, slots),
           False)
    return [int(s[0]) for s in slots]


def _padded(data: bytes, n: int) -> np.ndarray[Any, Any]:
    arr = np.zeros(n, np.uint8)
    arr[:len(data)] = np.frombuffer(data, np.uint8)
    return arr


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None,
                      allow_pickle: bool | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    if not isinstance(object_list, list) or len(object_list) != g.size():
        raise InvalidArgument(f"object_list must be a list of length {g.size()} (one slot per "
                              "rank)")
    pickle_ok = pickle_allowed(allow_pickle)
    data = dumps(obj, pickle_ok)
    sizes = _gather_sizes(g, len(data))
    width = max(sizes)
    slots = [np.zeros(width, np.uint8) for _ in range(g.size())]
    slots[g.group_rank][:] = _padded(data, width)
    launch(g, Op.all_gather_object, _U8, width, None, 0,
           lambda engine, call: engine.all_gather(call, slots), False)
    for i, (slot, n) in enumerate(zip(slots, sizes)):
        object_list[i] = loads(slot[:n].tobytes(), pickle_ok, f"rank {g.ranks[i]}")


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None,
                          allow_pickle: bool | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    _require_list(object_list, "object_list")
    root = _root(g, src, group_src, "src", default=0)
    pickle_ok = pickle_allowed(allow_pickle)
    is_root = g.group_rank == root
    data = dumps(list(object_list), pickle_ok) if is_root else b""
    size = np.array([len(data)], np.int64)
    launch(g, Op.broadcast_object_list, _I64, len(object_list), None, root,
           lambda engine, call: engine.broadcast(call, size, root), False)
    payload = _padded(data, int(size[0])) if is_root else np.zeros(int(size[0]), np.uint8)
    launch(g, Op.broadcast_object_list, _U8, int(size[0]), None, root,
           lambda engine, call: engine.broadcast(call, payload, root), False)
    if not is_root:
        values = loads(payload.tobytes(), pickle_ok, f"rank {g.ranks[root]}")
        if not isinstance(values, list) or len(values) != len(object_list):
            raise CollectiveMismatch("broadcast_object_list: the source sent a list of a "
                                     "different length than this rank's object_list")
        object_list[:] = values


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None,
                  allow_pickle: bool | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    root = _root(g, dst, group_dst, "dst", default=0)
    is_root = g.group_rank == root
    if is_root and (not isinstance(object_gather_list, list)
                    or len(object_gather_list) != g.size()):
        raise InvalidArgument(f"object_gather_list must be a list of length {g.size()} on the "
                              "destination rank")
    pickle_ok = pickle_allowed(allow_pickle)
    data = dumps(obj, pickle_ok)
    sizes = _gather_sizes(g, len(data))
    width = max(sizes)
    mine = _padded(data, width)
    slots = [np.zeros(width, np.uint8) for _ in range(g.size())] if is_root else None

    launch(g, Op.gather_object, _U8, width, None, root,
           lambda engine, call: engine.gather(call, mine, slots, root), False)
    if is_root:
        assert slots is not None and object_gather_list is not None
        for i, (slot, n) in enumerate(zip(slots, sizes)):
            object_gather_list[i] = loads(slot[:n].tobytes(), pickle_ok, f"rank {g.ranks[i]}")


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None,
                        group_src: int | None = None,
                        allow_pickle: bool | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise InvalidArgument("scatter_object_output_list must be a non-empty list")
    root = _root(g, src, group_src, "src", default=0)
    is_root = g.group_rank == root
    pickle_ok = pickle_allowed(allow_pickle)
    n = g.size()
    sizes = np.zeros(n, np.int64)
    blobs: list[bytes] = []
    if is_root:
        if not isinstance(scatter_object_input_list, list) or \
                len(scatter_object_input_list) != n:
            raise InvalidArgument(f"scatter_object_input_list must be a list of length {n} on "
                                  "the source rank")
        blobs = [dumps(o, pickle_ok) for o in scatter_object_input_list]
        sizes[:] = [len(b) for b in blobs]
    launch(g, Op.scatter_object_list, _I64, n, None, root,
           lambda engine, call: engine.broadcast(call, sizes, root), False)
    width = int(sizes.max())
    slots = [_padded(b, width) for b in blobs] if is_root else None
    out = np.zeros(width, np.uint8)
    launch(g, Op.scatter_object_list, _U8, width, None, root,
           lambda engine, call: engine.scatter(call, out, slots, root), False)
    mine = int(sizes[g.group_rank])
    scatter_object_output_list[0] = loads(out[:mine].tobytes(), pickle_ok,
                                          f"rank {g.ranks[root]}")


def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None,
                     allow_pickle: bool | None = None) -> None:
    g = resolve_group(group)
    if g is None:
        return
    _require_list(object_list, "object_list")
    peer = _peer(g, dst, group_dst, "dst")
    data = dumps(list(object_list), pickle_allowed(allow_pickle))
    g.comm.router.check_alive([peer])
    g.comm.send(peer, Kind.OBJ, data, time.monotonic() + g.timeout, group=g.id,
                site=capture(), tag=len(object_list))


def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None,
                     allow_pickle: bool | None = None) -> int:
    g = resolve_group(group)
    if g is None:
        return -1
    _require_list(object_list, "object_list")
    peer = _peer(g, src, group_src, "src", allow_any=True)
    g.comm.router.check_alive()
    pending = g.comm.router.post_p2p(Kind.OBJ, g.id, peer, len(object_list), None)
    site = capture()
    frame = g.comm.wait(pending, time.monotonic() + g.timeout,
                        lambda: f"rank {g.comm.rank} timed out in recv_object_list at "
                                f"{site.short}: no send_object_list of {len(object_list)} "
                                "objects arrived")
    assert pending.buffer is not None
    values = loads(bytes(pending.buffer), pickle_allowed(allow_pickle), f"rank {frame.src}")
    if not isinstance(values, list) or len(values) != len(object_list):
        raise InvalidArgument("recv_object_list: the sender's list has a different length")
    object_list[:] = values
    return frame.src
