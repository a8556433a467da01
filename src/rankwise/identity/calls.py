"""Call identity: how a collective call is named, compared and explained to the user.

Why its own module at the bottom: the communicator, both engines and the diagnosis
reports all describe calls the same way ("all_reduce(float32 x 4, op=SUM) at
train.py:42"), and none of them may import the API to do it.
"""

from __future__ import annotations

import zlib
from contextvars import ContextVar
from typing import NamedTuple, Protocol

from ..wire.buffers import dtype_name, reduce_op_by_code
from ..wire.frames import CALL_FLAGS, Flag, Frame, Op
from .callsite import CallSite

__all__ = ["BARRIER_NAMES", "COMM_LABEL", "DEVICE_MARK", "CallFields", "Fingerprint",
           "barrier_name_code", "describe", "describe_call", "flags_shown", "mismatch_advice"]

#: how a description shows ``Flag.DEVICE`` (after the arguments, before the call site)
DEVICE_MARK = " on CUDA"

#: the profiling name that ``record_comm`` gives the collectives issued inside it (a
#: context variable: threads and asyncio tasks each see their own). A label, not
#: identity: ranks may label the same call differently, so it is never compared.
COMM_LABEL: ContextVar[str | None] = ContextVar("rankwise_comm_label", default=None)

class Fingerprint(NamedTuple):
    """What must agree across ranks for one collective call.

    A named tuple, not a frozen dataclass: one is built per call, and the tuple is made
    in C (~0.3 us) where the dataclass's ``__init__`` set each field through
    ``object.__setattr__`` (~1 us). Its fields in the order a frame header carries them
    (``Frame[3:9]``): the router keeps the fingerprint itself as the fields a matching
    frame must carry, where it kept a tuple made per call (and alive for 1,024 calls:
    enough to reach the collector's oldest generation, whose passes then came often)."""

    op: int
    dtype: int
    reduce: int
    flags: int  #: the call flags (``wire.frames.CALL_FLAGS``), e.g. SYNC on a block's barrier
    root: int
    count: int  # type: ignore[assignment]  # shadows tuple.count; -1: counts may differ

    def differs(self, f: Frame) -> bool:
        if (f.op, f.dtype, f.reduce, f.root, f.flags & CALL_FLAGS) != \
                (self.op, self.dtype, self.reduce, self.root, self.flags):
            return True
        return self.count != -1 and f.count != -1 and f.count != self.count


#: names of named barriers seen by this process, by their fingerprint code
BARRIER_NAMES: dict[int, str] = {}


def barrier_name_code(name: str) -> int:
    """The fingerprint ``count`` of ``barrier(name=...)``: never 0 (unnamed) or -1."""
    code = (zlib.crc32(name.encode("utf-8", "replace")) | (1 << 32))
    BARRIER_NAMES.setdefault(code, name)
    return code




class CallFields(Protocol):
    """What a call is compared by: a ``Fingerprint`` has these fields, so does a ``Frame``
    (the header of a peer's call)."""

    @property
    def op(self) -> int: ...
    @property
    def dtype(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def reduce(self) -> int: ...
    @property
    def root(self) -> int: ...
    @property
    def flags(self) -> int: ...


def op_name(op: int) -> str:
    """The name of op code ``op`` (``all_reduce``), as messages show it."""
    return Op(op).name if op in Op._value2member_map_ else f"op#{op}"


def describe(call: CallFields, site: CallSite | None = None,
             shape: tuple[int, ...] | None = None) -> str:
    """``describe_call`` of a fingerprint or a frame header."""
    return describe_call(call.op, call.dtype, call.count, call.reduce, call.root, site, shape,
                         flags=call.flags)


def describe_call(op: int, dtype: int, count: int, reduce: int, root: int,
                  site: CallSite | None, shape: tuple[int, ...] | None = None, *,
                  flags: int = 0) -> str:
    """``all_reduce(float32 x 1024, op=SUM) at train.py:42 in step``; with the user's
    tensor's ``shape`` (when it is not flat): ``all_reduce(float32[2, 2], op=SUM)``.
    Shapes are only shown: ranks agree when their element counts do. ``flags``: the
    call's header flags (``Flag.SYNC``: the barrier of a rank-0-first block; ``Flag.DEVICE``:
    CUDA tensors on a group whose NCCL plane moves them, shown as "on CUDA")."""
    name = op_name(op)
    args = []
    if op == Op.barrier and count > 0:
        label = BARRIER_NAMES.get(count)
        if flags & Flag.SYNC:
            name = "rank_zero_first"
            args.append("the barrier of a rank-0-first block" if label is None
                        else f"block at {label.partition('@')[2] or label}")
        else:
            args.append(f"name={label!r}" if label is not None else f"name=#{count & 0xFFFFFFFF:08x}")
    if dtype and shape is not None and len(shape) != 1:
        args.append(f"{dtype_name(dtype)}[{', '.join(map(str, shape))}]")
    elif dtype:
        args.append(f"{dtype_name(dtype)} x {count}" if count >= 0 else dtype_name(dtype))
    rop = reduce_op_by_code(reduce)
    if rop is not None:
        args.append(f"op={rop.name}")
    if op in (Op.broadcast, Op.scatter, Op.reduce, Op.gather, Op.broadcast_object_list,
              Op.gather_object, Op.scatter_object_list):
        args.append(f"root={root}")
    plane = DEVICE_MARK if flags & Flag.DEVICE else ""
    where = f" at {site.short}" if site is not None and site.frames else ""
    return f"{name}({', '.join(args)}){plane}{where}"


def flags_shown(text: str) -> int:
    """The call flags a description shows (a peer's who-is-where report carries its calls
    as text): what ``mismatch_advice`` needs to word a mismatch found in reports."""
    flags = 0
    if ")" + DEVICE_MARK in text:
        flags |= Flag.DEVICE
    if text.startswith("rank_zero_first("):
        flags |= Flag.SYNC
    return flags


def mismatch_advice(flags_a: int, flags_b: int) -> str:
    """What to do about a mismatch between calls whose header flags are ``flags_a`` and
    ``flags_b``, whichever engine found it; names the rank-0-first trap when one side is
    its barrier (``Flag.SYNC``)."""
    advice = ("Every rank of a group must make the same collective calls in the same order, "
              "with the same op, dtype, element count, root and reduce op.")
    if (flags_a | flags_b) & Flag.SYNC:
        advice += (
            "\nThis is the rank-0-first trap: a rank_zero_first/main_process_first block "
            "was entered by some ranks only (for example from an `if rank == 0:` branch "
            "that builds a validation loader with a helper that uses it inside), so its "
            "barrier met a different collective on the other ranks. Fix: enter the block "
            "on every rank of the group, or do not use it on the rank-0-only path "
            "(the seed's fix: pass rank=-1 there).")
    if (flags_a ^ flags_b) & Flag.DEVICE:
        advice += (
            "\nOne side passed CUDA tensors and the other CPU tensors (or numpy arrays): "
            "on a group with NCCL, CUDA tensors go to NCCL and CPU tensors to the CPU "
            "backend, so the two calls can never meet. Put the tensor on the same device "
            "on every rank (`tensor.to(device)`).")
    return advice
