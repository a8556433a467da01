"""The tensor collectives of torch.distributed, validated locally before any I/O.

Each function: resolve the group (a non-member rank returns at once, as in torch),
turn tensors into flat buffers (rejecting wrong types, non-contiguous memory, wrong
list lengths and sizes with ``InvalidArgument``), build the call's fingerprint, then
run it on the group's engine through the one call path (``api.path.launch``) — inline,
or on the async worker with ``async_op``. A torch tensor's all_reduce takes
``api.plans.all_reduce_tensor``, as the torch backend's does.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..core.group import ProcessGroup
from ..core.work import Work
from ..engines.base import Call, Engine, Tiles
from ..errors import InvalidArgument
from ..identity.calls import barrier_name_code
from ..wire.buffers import Buffer, ReduceOp, as_buffer, premultiply
from ..wire.device import concat, flat_copy, same_memory
from ..wire.frames import Op
from .path import launch
from .plans import all_reduce_body, all_reduce_tensor, checked_reduce_op, views
from .world import resolve_group

__all__ = [
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "gather", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
]

def _same_dtype(bufs: list[Buffer], ref: Buffer, what: str) -> None:
    for i, b in enumerate(bufs):
        if b.dtype != ref.dtype:
            if b.dtype.tensor != ref.dtype.tensor:
                raise InvalidArgument(f"{what}[{i}] is on {_device(b)} but the input is on "
                                      f"{_device(ref)}; all tensors of one call share a device")
            raise InvalidArgument(f"{what}[{i}] has dtype {b.dtype.name} but the input has "
                                  f"{ref.dtype.name}; all tensors of one call share a dtype")


def _device(b: Buffer) -> str:
    where = getattr(b.original, "device", None)
    return "the host (numpy)" if where is None else str(where)


def _list(xs: Any, n: int, what: str, writable: bool) -> list[Buffer]:
    if not isinstance(xs, (list, tuple)):
        raise InvalidArgument(f"{what} must be a list of tensors, got {type(xs).__name__}")
    if len(xs) != n:
        raise InvalidArgument(f"{what} has {len(xs)} tensors but the group has {n} ranks; "
                              "it needs exactly one per rank")
    return [as_buffer(x, f"{what}[{i}]", writable) for i, x in enumerate(xs)]


def _equal_sizes(bufs: list[Buffer], numel: int, what: str) -> None:
    for i, b in enumerate(bufs):
        if b.numel != numel:
            raise InvalidArgument(f"{what}[{i}] has {b.numel} elements, expected {numel}")


_reduce_op = checked_reduce_op


# --- collectives --------------------------------------------------------------------------

def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src")
    return launch(g, Op.broadcast, buf.dtype, buf.numel, None, root,
                  lambda engine, call: engine.broadcast(call, buf.array, root), async_op,
                  shape=buf.shape, outputs=[tensor])


def _root(g: ProcessGroup, global_rank: int | None, group_rank: int | None, name: str,
          default: int | None = None) -> int:
    """The group-local index of a root given as a global rank (torch's ``src``/``dst``)
    or as a group rank (``group_src``/``group_dst``); ``default`` when neither is given."""
    if global_rank is None and group_rank is None and default is not None:
        global_rank = default
    if global_rank is not None and group_rank is not None:
        raise InvalidArgument(f"pass {name} or group_{name}, not both")
    if group_rank is not None:
        if not isinstance(group_rank, int) or not 0 <= group_rank < g.size():
            raise InvalidArgument(f"group_{name}={group_rank!r} is not in 0..{g.size() - 1}")
        return group_rank
    if global_rank is None:
        raise InvalidArgument(f"{name} (the root rank) is required")
    return g.group_rank_of(global_rank, name)


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        # the torch backend's allreduce asks the same: one view cache, one plan per view
        return all_reduce_tensor(g, tensor, op, async_op, [tensor])
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "all_reduce")
    return launch(g, Op.all_reduce, buf.dtype, buf.numel, rop, 0, all_reduce_body(buf, rop),
                  async_op, shape=buf.shape, outputs=[tensor], split=True)


def tensor_view(tensor: Any) -> tuple[Buffer, dict[Any, Any] | None]:
    """``as_buffer(tensor, "tensor", writable=True)`` of a torch tensor, remembered while
    the tensor stays as it was (``api.views``), and its memo (None: not kept)."""
    return views().view(tensor, "tensor")


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "reduce")
    root = _root(g, dst, group_dst, "dst")

    def body(engine: Engine, call: Call) -> None:
        premultiply(buf.array, buf.dtype, rop)  # torch leaves non-root tensors undefined
        engine.reduce(call, buf.array, root)

    return launch(g, Op.reduce, buf.dtype, buf.numel, rop, root, body, async_op,
                  shape=buf.shape, outputs=[tensor])


def all_gather(tensor_list: Any, tensor: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(tensor, "tensor")
    outs = _list(tensor_list, g.size(), "tensor_list", writable=True)
    _same_dtype(outs, mine, "tensor_list")
    _equal_sizes(outs, mine.numel, "tensor_list")
    slots = [b.array for b in outs]

    def body(engine: Engine, call: Call) -> None:
        if not same_memory(slots[call.rank], mine.array):
            slots[call.rank][...] = mine.array
        engine.all_gather(call, slots)

    return launch(g, Op.all_gather, mine.dtype, mine.numel, None, 0, body, async_op,
                  shape=mine.shape, outputs=[list(tensor_list)], inputs=[tensor])


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(input_tensor, "input_tensor")
    out = as_buffer(output_tensor, "output_tensor", writable=True)
    _same_dtype([out], mine, "output_tensor")
    n = g.size()
    if out.numel != n * mine.numel:
        raise InvalidArgument(f"output_tensor has {out.numel} elements; it needs world size "
                              f"({n}) x input size ({mine.numel}) = {n * mine.numel}")
    slots = Tiles([out.array[i * mine.numel:(i + 1) * mine.numel] for i in range(n)],
                  out.array)

    def body(engine: Engine, call: Call) -> None:
        if not same_memory(slots[call.rank], mine.array):
            slots[call.rank][...] = mine.array
        engine.all_gather(call, slots)

    return launch(g, Op.all_gather_into_tensor, mine.dtype, mine.numel, None, 0, body, async_op,
                  shape=mine.shape, outputs=[output_tensor], inputs=[input_tensor])


#: torch 2.13's name for it (it deprecates ``all_gather_into_tensor`` in its favour); the
#: same call, so ranks that mix the two names still match
all_gather_single = all_gather_into_tensor


def _root_slots(g: ProcessGroup, root: int, xs: Any, ref: Buffer, op: str, name: str,
                role: str, writable: bool) -> list[np.ndarray[Any, Any]] | None:
    """The root's per-rank tensor list for gather/scatter, validated; None elsewhere.

    As in torch, the list is required on the root and must be None (or empty) on the
    other ranks."""
    if g.group_rank != root:
        if xs:
            raise InvalidArgument(f"{op}: {name} must be None on ranks other than {role} "
                                  f"(rank {g.ranks[root]}), as in torch.distributed")
        return None
    if xs is None:
        raise InvalidArgument(f"{op}: {name} is required on the {role} rank")
    bufs = _list(xs, g.size(), name, writable=writable)
    _same_dtype(bufs, ref, name)
    _equal_sizes(bufs, ref.numel, name)
    return [b.array for b in bufs]


def gather(tensor: Any, gather_list: Any = None, dst: int | None = None, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(tensor, "tensor")
    root = _root(g, dst, group_dst, "dst", default=0)
    slots = _root_slots(g, root, gather_list, mine, "gather", "gather_list", "dst", True)
    return launch(g, Op.gather, mine.dtype, mine.numel, None, root,
                  lambda engine, call: engine.gather(call, mine.array, slots, root), async_op,
                  shape=mine.shape, inputs=[tensor])


def scatter(tensor: Any, scatter_list: Any = None, src: int | None = None, group: Any = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src", default=0)
    slots = _root_slots(g, root, scatter_list, out, "scatter", "scatter_list", "src", False)
    return launch(g, Op.scatter, out.dtype, out.numel, None, root,
                  lambda engine, call: engine.scatter(call, out.array, slots, root), async_op,
                  shape=out.shape, inputs=[tensor])


def reduce_scatter(output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    ins = _list(input_list, g.size(), "input_list", writable=False)
    _same_dtype(ins, out, "input_list")
    _equal_sizes(ins, out.numel, "input_list")
    rop = _reduce_op(op, out, "reduce_scatter")
    work = concat([b.array for b in ins]) if ins else flat_copy(out.array)
    return _reduce_scatter(g, Op.reduce_scatter, out, work, rop, async_op, input_list)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    inp = as_buffer(input, "input")
    _same_dtype([inp], out, "input")
    if inp.numel != g.size() * out.numel:
        raise InvalidArgument(f"input has {inp.numel} elements; it needs world size "
                              f"({g.size()}) x output size ({out.numel})")
    rop = _reduce_op(op, out, "reduce_scatter_tensor")
    return _reduce_scatter(g, Op.reduce_scatter_tensor, out, flat_copy(inp.array), rop,
                           async_op, [input])


#: torch 2.13's name for it (it deprecates ``reduce_scatter_tensor`` in its favour)
reduce_scatter_single = reduce_scatter_tensor


def _reduce_scatter(g: ProcessGroup, op: Op, out: Buffer, work: np.ndarray[Any, Any],
                    rop: ReduceOp, async_op: bool, inputs: Any) -> Work | None:
    n, m = g.size(), out.numel
    chunks = Tiles([work[i * m:(i + 1) * m] for i in range(n)], work)

    def body(engine: Engine, call: Call) -> None:
        premultiply(work, out.dtype, rop)  # a private copy of the input
        engine.reduce_scatter(call, chunks)
        out.array[...] = chunks[call.rank]

    return launch(g, op, out.dtype, out.numel, rop, 0, body, async_op, shape=out.shape,
                  outputs=[out.original], inputs=list(inputs))


def all_to_all(output_tensor_list: Any, input_tensor_list: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    outs = _list(output_tensor_list, g.size(), "output_tensor_list", writable=True)
    ins = _list(input_tensor_list, g.size(), "input_tensor_list", writable=False)
    _same_dtype(outs, ins[0], "output_tensor_list")
    _same_dtype(ins, ins[0], "input_tensor_list")
    me = g.group_rank
    if outs[me].numel != ins[me].numel:
        raise InvalidArgument(f"output_tensor_list[{me}] has {outs[me].numel} elements but "
                              f"input_tensor_list[{me}] (what this rank sends itself) has "
                              f"{ins[me].numel}")
    return launch(g, Op.all_to_all, ins[0].dtype, -1, None, 0,
                  lambda engine, call: engine.all_to_all(call, [b.array for b in outs],
                                                         [b.array for b in ins]), async_op,
                  inputs=list(input_tensor_list))


def _splits(buf: Buffer, sizes: Any, n: int, what: str) -> list[np.ndarray[Any, Any]]:
    rows = buf.shape[0] if buf.shape else 1
    per_row = buf.numel // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise InvalidArgument(f"{what}: dim 0 ({rows}) is not divisible by the group size "
                                  f"({n}); pass split sizes")
        sizes = [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or any(not isinstance(s, int) or s < 0 for s in sizes):
        raise InvalidArgument(f"{what} split sizes {sizes} must be {n} non-negative ints")
    if sum(sizes) != rows:
        raise InvalidArgument(f"{what} split sizes {sizes} sum to {sum(sizes)}, but dim 0 "
                              f"has {rows} rows")
    out, start = [], 0
    for s in sizes:
        out.append(buf.array[start * per_row:(start + s) * per_row])
        start += s
    return out


def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None,
                      async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    inp = as_buffer(input, "input")
    _same_dtype([out], inp, "output")
    outs = _splits(out, output_split_sizes, g.size(), "output")
    ins = _splits(inp, input_split_sizes, g.size(), "input")
    me = g.group_rank
    if len(outs[me]) != len(ins[me]):
        raise InvalidArgument(f"output split {me} has {len(outs[me])} elements but input "
                              f"split {me} has {len(ins[me])}")
    return launch(g, Op.all_to_all_single, inp.dtype, -1, None, 0,
                  lambda engine, call: engine.all_to_all(call, outs, ins), async_op,
                  inputs=[input])


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            name: str | None = None) -> Work | None:
    """torch's barrier; ``name`` (rankwise) must then match on every rank: barriers from
    different code pair silently otherwise (the seed-000 trap), a named one cannot."""
    g = resolve_group(group)
    if g is None:
        return None
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"barrier name must be a str, got {name!r}")
    code = barrier_name_code(name) if name else 0  # the name's hash rides in the fingerprint
    return launch(g, Op.barrier, None, code, None, 0,
                  lambda engine, call: engine.barrier(call), async_op, inputs=[])
