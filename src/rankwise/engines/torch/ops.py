"""What torch's backends are handed: the options objects of rankwise's calls, made once,
and the dtype workarounds gloo (and NCCL) need. Kept apart from the engine so that the
engine is its calls and its waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["AG_OPTS", "ALLREDUCE_OPTS", "AS_IS", "FLAT_REDUCE", "RS_OPTS", "as_bytes",
           "broadcast_options", "nothing", "reduce_in"]

#: PREMUL_SUM is a SUM here: the API multiplied each rank's input by its factor already
_OPS = {"SUM": tdist.ReduceOp.SUM, "AVG": tdist.ReduceOp.AVG,
        "PRODUCT": tdist.ReduceOp.PRODUCT, "MIN": tdist.ReduceOp.MIN,
        "MAX": tdist.ReduceOp.MAX, "BAND": tdist.ReduceOp.BAND,
        "BOR": tdist.ReduceOp.BOR, "BXOR": tdist.ReduceOp.BXOR,
        "PREMUL_SUM": tdist.ReduceOp.SUM}


def _allreduce_options(op: Any) -> Any:
    o = tdist.AllreduceOptions()
    o.reduceOp = op
    return o


#: one options object per reduce op, shared by every call: building one (and setting its
#: pybind ``reduceOp``) cost more than the rest of the engine's per-call Python, and torch
#: copies the options into each op it enqueues, so the objects are never changed after
ALLREDUCE_OPTS = {name: _allreduce_options(op) for name, op in _OPS.items()}

#: the reduce ops gloo's ``_reduce_scatter_base`` runs (PREMUL_SUM: premultiplied, a SUM)
FLAT_REDUCE = ("SUM", "PREMUL_SUM", "MIN", "MAX", "PRODUCT")


def _reduce_scatter_options(op: Any) -> Any:
    o = tdist.ReduceScatterOptions()
    o.reduceOp = op
    return o


RS_OPTS = {name: _reduce_scatter_options(_OPS[name]) for name in FLAT_REDUCE}
AG_OPTS = torch._C._distributed_c10d.AllgatherOptions()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: every dtype moves as uint8 (gloo and NCCL lack some types)."""
    return t.view(torch.uint8)


_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}
_TOP = -(1 << 63)  #: the top bit of an int64


#: dtypes that torch's backends reduce as they are: the common case takes no conversion
#: and no write-back (bfloat16 included: ``values`` gives its torch view)
AS_IS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                    torch.uint8, torch.int32, torch.int64, torch.bool))


def nothing() -> None:
    return None


def reduce_in(t: torch.Tensor, op: str) -> tuple[torch.Tensor, Callable[[], object]]:
    """A tensor torch's backends can reduce for ``t`` and what writes the result back.

    gloo (and NCCL) lack int16 and the wide unsigned types: those are reduced widened (the
    narrowing copy back wraps exactly as the narrow arithmetic would), and uint64 as
    int64 (same bits for sums, products and bitwise ops; MIN/MAX flip the top bit so
    signed order equals unsigned order). Complex sums reduce the real view.
    """
    wider = _WIDER.get(t.dtype)
    if wider is not None:
        w = t.to(wider)
        return w, lambda: t.copy_(w)
    if t.dtype is torch.uint64:
        v = t.view(torch.int64)
        if op in ("MIN", "MAX"):
            v.bitwise_xor_(_TOP)
            return v, lambda: v.bitwise_xor_(_TOP)
        return v, nothing
    real = _REAL.get(t.dtype)
    if real is not None and op in ("SUM", "AVG"):
        return t.view(real), nothing
    return t, nothing


def broadcast_options(root: int) -> Any:
    o = tdist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o
