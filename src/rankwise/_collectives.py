"""The tensor collectives of torch.distributed, validated locally before any I/O.

Each function: resolve the group (a non-member rank returns at once, as in torch),
turn tensors into flat buffers (rejecting wrong types, non-contiguous memory, wrong
list lengths and sizes with ``InvalidArgument``), build the call's fingerprint, then
run an algorithm chosen by size — inline, or on the async worker with ``async_op``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import algorithms as alg
from ._buffers import Buffer, DType, ReduceOp, as_buffer, check_reducible, coerce_reduce_op
from ._callsite import capture
from ._comm import Activity, barrier_name_code
from ._group import OpLink, ProcessGroup
from ._router import Fingerprint
from ._wire import Op
from ._work import Work, run_async
from ._world import resolve_group
from .errors import InvalidArgument

__all__ = [
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter",
]

#: below this many bytes all_reduce uses recursive doubling (latency), above it the ring
RING_THRESHOLD = int(os.environ.get("RANKWISE_RING_THRESHOLD", str(256 << 10)))
ALLREDUCE_ALGORITHM = os.environ.get("RANKWISE_ALLREDUCE", "auto")
#: from this size a blocking collective reads its own frames (transport.drive_begin):
#: the hand-over costs a few wake-ups, each saved frame hand-off one or two
DRIVE_BYTES = int(os.environ.get("RANKWISE_DRIVE_BYTES", str(256 << 10)))


def launch(group: ProcessGroup, op: Op, dtype: DType | None, count: int,
           reduce_op: ReduceOp | None, root: int, body: Callable[[OpLink], None],
           async_op: bool) -> Work | None:
    """Register the call (sequence number, fingerprint, call site) and run ``body``."""
    site = capture()
    fp = Fingerprint(int(op), dtype.code if dtype else 0, reduce_op.code if reduce_op else 0,
                     root, count)
    seq, record = group.begin(fp, site)
    link = OpLink(group, seq, record, dtype, reduce_op)
    comm = group.comm

    big = dtype is not None and count * dtype.storage.itemsize >= DRIVE_BYTES

    def run() -> None:
        comm.activity = Activity(op.name, group.id, seq, site, time.time())
        transport = comm.transport
        drive = big and transport.drive_begin()
        try:
            body(link)
        finally:
            if drive:
                transport.drive_end()
            comm.call_done(group, record)  # history, trace span, back to "user code"

    if async_op:
        return run_async(f"{op.name} #{seq} on {group.name}", run)
    run()
    return None


def _same_dtype(bufs: list[Buffer], ref: Buffer, what: str) -> None:
    for i, b in enumerate(bufs):
        if b.dtype != ref.dtype:
            raise InvalidArgument(f"{what}[{i}] has dtype {b.dtype.name} but the input has "
                                  f"{ref.dtype.name}; all tensors of one call share a dtype")


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


def _reduce_op(op: Any, buf: Buffer, what: str) -> ReduceOp:
    rop = coerce_reduce_op(op)
    check_reducible(buf.dtype, rop, what)
    return rop


# --- collectives --------------------------------------------------------------------------

def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src")
    return launch(g, Op.broadcast, buf.dtype, buf.numel, None, root,
                  lambda link: alg.tree.broadcast(link, buf.array, root), async_op)


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
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "all_reduce")
    arr = buf.array
    algorithm = _all_reduce_algorithm(buf.nbytes, buf.numel, g.size())
    return launch(g, Op.all_reduce, buf.dtype, buf.numel, rop, 0,
                  lambda link: algorithm(link, arr), async_op)


def _all_reduce_algorithm(nbytes: int, numel: int, n: int) -> Callable[..., None]:
    """Latency-bound sizes: recursive doubling (log2 n rounds). Bandwidth-bound sizes:
    Rabenseifner on powers of two (2 log2 n hops), else the pipelined ring.
    ``RANKWISE_ALLREDUCE`` = doubling | ring | halving forces one (benchmarking)."""
    forced = ALLREDUCE_ALGORITHM
    if forced == "doubling" or (forced == "auto" and (nbytes < RING_THRESHOLD or numel < n)):
        return alg.doubling.all_reduce
    if numel < n:
        return alg.doubling.all_reduce
    if forced == "ring" or not alg.halving.usable(n):
        return alg.ring.all_reduce
    return alg.halving.all_reduce


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "reduce")
    root = _root(g, dst, group_dst, "dst")
    return launch(g, Op.reduce, buf.dtype, buf.numel, rop, root,
                  lambda link: alg.tree.reduce(link, buf.array, root), async_op)


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

    def body(link: OpLink) -> None:
        if not np.shares_memory(slots[link.rank], mine.array):
            slots[link.rank][...] = mine.array
        alg.ring.all_gather(link, slots)

    return launch(g, Op.all_gather, mine.dtype, mine.numel, None, 0, body, async_op)


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
    slots = [out.array[i * mine.numel:(i + 1) * mine.numel] for i in range(n)]

    def body(link: OpLink) -> None:
        if not np.shares_memory(slots[link.rank], mine.array):
            slots[link.rank][...] = mine.array
        alg.ring.all_gather(link, slots)

    return launch(g, Op.all_gather_into_tensor, mine.dtype, mine.numel, None, 0, body, async_op)


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
                  lambda link: alg.direct.gather(link, mine.array, slots, root), async_op)


def scatter(tensor: Any, scatter_list: Any = None, src: int | None = None, group: Any = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src", default=0)
    slots = _root_slots(g, root, scatter_list, out, "scatter", "scatter_list", "src", False)
    return launch(g, Op.scatter, out.dtype, out.numel, None, root,
                  lambda link: alg.direct.scatter(link, out.array, slots, root), async_op)


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
    work = np.concatenate([b.array for b in ins]) if ins else out.array.copy()
    return _reduce_scatter(g, Op.reduce_scatter, out, work, rop, async_op)


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
    return _reduce_scatter(g, Op.reduce_scatter_tensor, out, inp.array.copy(), rop, async_op)


def _reduce_scatter(g: ProcessGroup, op: Op, out: Buffer, work: np.ndarray[Any, Any],
                    rop: ReduceOp, async_op: bool) -> Work | None:
    n, m = g.size(), out.numel
    chunks = [work[i * m:(i + 1) * m] for i in range(n)]

    def body(link: OpLink) -> None:
        alg.ring.reduce_scatter(link, chunks)
        out.array[...] = chunks[link.rank]

    return launch(g, op, out.dtype, out.numel, rop, 0, body, async_op)


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
                  lambda link: alg.direct.all_to_all(link, [b.array for b in outs],
                                                     [b.array for b in ins]), async_op)


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
    if outs[me].size != ins[me].size:
        raise InvalidArgument(f"output split {me} has {outs[me].size} elements but input "
                              f"split {me} has {ins[me].size}")
    return launch(g, Op.all_to_all_single, inp.dtype, -1, None, 0,
                  lambda link: alg.direct.all_to_all(link, outs, ins), async_op)


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
    return launch(g, Op.barrier, None, code, None, 0, alg.doubling.barrier, async_op)
