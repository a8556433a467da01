"""A torch tensor's all_reduce, for both entry points: one view cache and one plan per kept
tensor and reduce op.

Why: a training loop (a metric ``all_reduce``, DDP's buckets, through rankwise's API or
torch's backend "rankwise") hands the same few tensors to every call. Both entries ask
``all_reduce_tensor``, which asks the one ``TensorViews`` cache (``api.views``) for the
tensor's view and memo and keeps there, per reduce op, the call's checked body, element
count and fingerprint (``Plan``): nothing is derived again, or bound, per call. A tensor
the cache does not keep (over ``views.MAX_BYTES``, past ``views.MAX_KEPT``, or requiring grad) is viewed and
checked afresh, and no plan is made for it: its call has its body and fingerprint alone. Then ``path.launch``, as every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engines.base import Call, Engine
from ..identity.calls import Fingerprint
from ..wire.buffers import Buffer, DType, ReduceOp, check_reducible, coerce_reduce_op, premultiply
from ..wire.frames import Op
from .path import Body, launch

if TYPE_CHECKING:
    from ..core.group import ProcessGroup
    from ..core.work import Work
    from .views import TensorViews

__all__ = ["Plan", "all_reduce_body", "all_reduce_tensor", "checked_reduce_op", "memo_plan",
           "views"]

#: (dtype code, reduce-op code) pairs already found reducible: the check's answer
#: depends on nothing else, and a training loop asks the same question every step
_REDUCIBLE: set[tuple[int, int]] = set()


def checked_reduce_op(op: Any, buf: Buffer, what: str) -> ReduceOp:
    """``op`` as a ``ReduceOp``, refused (``InvalidArgument``) where ``buf``'s dtype
    cannot be reduced by it."""
    rop = coerce_reduce_op(op)
    key = (buf.dtype.code, rop.code)
    if key not in _REDUCIBLE:
        check_reducible(buf.dtype, rop, what)
        _REDUCIBLE.add(key)
    return rop


class Plan:
    """A view's all_reduce for one reduce op (``memo_plan``): its checked body, its
    element count (a flat tensor's ``shape[0]`` is a torch call, ~0.25 us) and its
    fingerprint once ``launch`` made it: the same on every call of the view."""

    __slots__ = ("array", "body", "count", "dtype", "fp", "rop", "shape")

    def __init__(self, body: Body, buf: Buffer, rop: ReduceOp) -> None:
        self.body = body
        self.array = buf.array
        self.count = buf.numel
        self.dtype: DType = buf.dtype
        self.shape = buf.shape
        self.rop = rop
        self.fp: Fingerprint | None = None


def memo_plan(buf: Buffer, memo: dict[Any, Any], rop: ReduceOp) -> Plan:
    """The all_reduce plan of a view (``memo``: its memo) for ``rop``, checked and made on
    its first use; PREMUL_SUM's factor may change between calls, so its plan is made anew.
    Keyed by the op's code: hashing a ``ReduceOp`` runs its Python ``__hash__``."""
    if rop.factor is not None:  # kept nowhere: a bare PREMUL_SUM must find no plan
        return Plan(all_reduce_body(buf, checked_reduce_op(rop, buf, "all_reduce")), buf, rop)
    plan: Plan | None = memo.get(rop.code)
    if plan is None:
        plan = memo[rop.code] = Plan(
            all_reduce_body(buf, checked_reduce_op(rop, buf, "all_reduce")), buf, rop)
    return plan


def all_reduce_body(buf: Buffer, rop: ReduceOp) -> Body:
    """What ``all_reduce`` runs on the engine, for a viewed and checked buffer (only
    PREMUL_SUM's body scales this rank's input first: the others skip that call)."""
    arr, dtype = buf.array, buf.dtype

    def body(engine: Engine, call: Call) -> None:
        engine.all_reduce(call, arr)

    def scaled(engine: Engine, call: Call) -> None:
        premultiply(arr, dtype, rop)
        engine.all_reduce(call, arr)

    return body if rop.factor is None else scaled


#: the one view cache (``api.views``, which imports torch: made when the first torch
#: tensor comes), for every entry point
_views: TensorViews | None = None


def views() -> TensorViews:
    """The process's one ``TensorViews``."""
    global _views
    if _views is None:
        from .views import TensorViews
        _views = TensorViews()
    return _views


def all_reduce_tensor(group: ProcessGroup, tensor: Any, op: Any, async_op: bool,
                      outputs: list[Any], inputs: list[Any] | None = None) -> Work | None:
    """``all_reduce`` of one torch tensor on ``group``, from either entry point: the
    tensor's view and plan (kept while the tensor stays as it was), then ``launch``.
    ``outputs``/``inputs``: as ``launch``'s."""
    buf, memo = (_views if _views is not None else views()).view(tensor, "tensor")
    rop = op if op.__class__ is ReduceOp and op.factor is None else coerce_reduce_op(op)
    if memo is None:  # a view not kept (a large tensor): nothing made for later calls
        return launch(group, Op.all_reduce, buf.dtype, buf.numel, rop, 0,
                      all_reduce_body(buf, checked_reduce_op(rop, buf, "all_reduce")),
                      async_op, shape=buf.shape, outputs=outputs, inputs=inputs, depth=4,
                      split=True)
    # a bare PREMUL_SUM finds no plan (none with a factor is kept): ``memo_plan`` raises
    plan: Plan | None = memo.get(rop.code)
    if plan is None or rop.factor is not None:
        plan = memo_plan(buf, memo, rop)
    return launch(group, Op.all_reduce, plan.dtype, plan.count, rop, 0, plan.body, async_op,
                  shape=plan.shape, outputs=outputs, inputs=inputs, plan=plan, depth=4,
                  split=True)
