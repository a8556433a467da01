"""``ReduceOp``: torch.distributed's reduction operators, PREMUL_SUM's factor included.

Its own module so the operator names (and how foreign spellings of them are accepted)
stay apart from the buffer conversions that apply them.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import InvalidArgument

__all__ = ["ReduceOp", "coerce_reduce_op", "make_premul_sum", "reduce_op_by_code",
           "torch_premul_factor"]

_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


class ReduceOp:
    """Reduction operators, with torch.distributed's names (``ReduceOp.SUM`` ...).

    ``ReduceOp.PREMUL_SUM`` alone names the operator; a usable one carries the scalar
    each rank multiplies its input by before the sum: ``ReduceOp.premul_sum(0.5)``
    (torch spells it ``dist._make_nccl_premul_sum(0.5)``; both work here). The factor
    may differ between ranks, as in torch, so it is not part of the call's fingerprint.
    """

    SUM: ReduceOp
    AVG: ReduceOp
    PRODUCT: ReduceOp
    MIN: ReduceOp
    MAX: ReduceOp
    BAND: ReduceOp
    BOR: ReduceOp
    BXOR: ReduceOp
    PREMUL_SUM: ReduceOp

    __slots__ = ("code", "factor", "name")

    def __init__(self, code: int, name: str, factor: float | None = None) -> None:
        self.code = code
        self.name = name
        self.factor = factor

    @staticmethod
    def premul_sum(factor: Any) -> ReduceOp:
        return make_premul_sum(factor)

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}" + ("" if self.factor is None else f"({self.factor})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReduceOp) and other.code == self.code

    def __hash__(self) -> int:
        return self.code


for _code, _name in enumerate(_NAMES, 1):
    setattr(ReduceOp, _name, ReduceOp(_code, _name))
_OPS_BY_CODE: dict[int, ReduceOp] = {op.code: op for op in (getattr(ReduceOp, n) for n in _NAMES)}


def make_premul_sum(factor: Any) -> ReduceOp:
    """PREMUL_SUM with its factor: a real number (or a one-element tensor holding one)."""
    if not isinstance(factor, (int, float)) and hasattr(factor, "item"):  # a 1-element tensor
        numel = getattr(factor, "numel", None)
        if (numel() if callable(numel) else getattr(factor, "size", 1)) != 1:
            raise InvalidArgument("premul_sum: the factor tensor must hold one element")
        factor = factor.item()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
            not math.isfinite(float(factor)):
        raise InvalidArgument(f"premul_sum needs a finite real factor, got {factor!r}")
    return ReduceOp(ReduceOp.PREMUL_SUM.code, "PREMUL_SUM", float(factor))


def torch_premul_factor(op: Any) -> Any:
    """The factor of torch's ``_make_nccl_premul_sum(f)``: its ``factor`` (torch 2.13 on)
    or, before, the second half of its pickled state, which torch 2.11 and 2.12 give
    (``(RedOpType.PREMUL_SUM, f)``) though they expose no ``factor``."""
    factor = getattr(op, "factor", None)
    if factor is None:
        try:
            factor = op.__getstate__()[1]
        except (AttributeError, IndexError, TypeError, RuntimeError):
            factor = None
    if factor is None:
        raise InvalidArgument("PREMUL_SUM: this torch does not expose the factor of "
                              "_make_nccl_premul_sum(f) (no .factor, no pickled state); "
                              "scale the tensor by f and all_reduce with ReduceOp.SUM")
    return factor


def reduce_op_by_code(code: int) -> ReduceOp | None:
    return _OPS_BY_CODE.get(code)


def coerce_reduce_op(op: Any) -> ReduceOp:
    """Accept our ReduceOp, torch's ``ReduceOp.X`` / ``RedOpType.X``, or a name string."""
    if isinstance(op, ReduceOp):
        if op.name == "PREMUL_SUM" and op.factor is None:
            raise InvalidArgument("ReduceOp.PREMUL_SUM needs its factor: pass "
                                  "ReduceOp.premul_sum(factor)")
        return op
    kind = getattr(op, "op", None)  # a torch ReduceOp object (``opts.reduceOp``, torch's
    if kind is not None and not isinstance(op, str):  # _make_nccl_premul_sum(f)): its kind
        if getattr(kind, "name", None) == "PREMUL_SUM":
            return make_premul_sum(torch_premul_factor(op))
        return coerce_reduce_op(kind)
    name = getattr(op, "name", None) or (op if isinstance(op, str) else None)
    if name is None:
        text = str(op)  # torch: "RedOpType.SUM" or "ReduceOp.SUM"
        name = text.rsplit(".", 1)[-1]
    found = getattr(ReduceOp, str(name).upper(), None)
    if not isinstance(found, ReduceOp):
        raise InvalidArgument(f"unsupported reduce op {op!r}; use rankwise.ReduceOp.SUM/AVG/"
                              "PRODUCT/MIN/MAX/BAND/BOR/BXOR or ReduceOp.premul_sum(f)")
    return coerce_reduce_op(found)
