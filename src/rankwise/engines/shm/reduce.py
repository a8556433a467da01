"""Reducing the same span of every rank's slot in one call, in rank order.

Why not ``reduce_into`` once per peer: each call pays numpy's ``errstate`` (~1.5-2.5 us
here), which dominates a small all_reduce. The slots of all ranks sit at a fixed stride
in the segment, so one span across ranks is a strided ``(n, m)`` view, and one
``ufunc.reduce(axis=0)`` reduces it. numpy reduces an outer (non-contiguous) axis as
``((r0 op r1) op r2) ...``, i.e. rank order, the same sequence ``reduce_into`` applies, so
every rank gets the same bits. bool and bfloat16 keep going through ``reduce_into``
(which knows their special rules).

Why ``rows_reducer``: a small all_reduce runs this once per call, so the choice of ufunc
and of error handling is made once per (dtype, op) and cached; float reductions run
under numpy's ``errstate`` in its decorator form, which sets the thread's error state
without building a context-manager object per call (about half the cost of ``with``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ...wire.buffers import _UFUNCS, DType, ReduceOp, reduce_into

__all__ = ["Reducer", "reduce_pair", "reduce_rows", "rows_reducer"]

_BITWISE = frozenset(("BAND", "BOR", "BXOR"))

#: ``reducer(rows, out)``: ``out = rows[0] op rows[1] op ...`` (see ``reduce_rows``)
Reducer = Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]


@np.errstate(all="ignore")  # inf/nan propagate silently, as in torch
def _quiet(fn: Any, rows: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
    fn.reduce(rows, axis=0, out=out)


@np.errstate(all="ignore")
def _quiet_pair(fn: Any, x: npt.NDArray[Any], y: npt.NDArray[Any],
                out: npt.NDArray[Any]) -> None:
    fn(x, y, out=out)


def reduce_pair(out: npt.NDArray[Any], x: npt.NDArray[Any], y: npt.NDArray[Any], d: DType,
                op: ReduceOp) -> None:
    """``out = x op y`` in one pass (AVG: the sum): the first step of a rank-order
    reduction, the same bits as copying ``x`` to ``out`` and ``reduce_into(out, y)``
    without the copy's pass over memory. ``out`` must not overlap ``x`` or ``y``."""
    if d.kind in ("float", "complex", "int", "uint"):
        fn: Any = _UFUNCS[op.name]["int" if op.name in _BITWISE else "num"]
        if d.kind in ("float", "complex"):
            _quiet_pair(fn, x, y, out)
        else:
            fn(x, y, out=out)
        return
    np.copyto(out, x)
    reduce_into(out, y, d, op)


def _make(d: DType, op: ReduceOp) -> Reducer:
    if d.kind in ("float", "complex", "int", "uint"):
        fn: Any = _UFUNCS[op.name]["int" if op.name in _BITWISE else "num"]
        if d.kind in ("float", "complex"):
            return lambda rows, out: _quiet(fn, rows, out)
        return lambda rows, out: fn.reduce(rows, axis=0, out=out)

    def one_by_one(rows: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
        np.copyto(out, rows[0])
        for r in range(1, rows.shape[0]):
            reduce_into(out, rows[r], d, op)
    return one_by_one


_reducers: dict[tuple[int, int], Reducer] = {}


def rows_reducer(d: DType, op: ReduceOp) -> Reducer:
    """The reducer for ``d`` and ``op`` (AVG: the sum; the caller divides), cached."""
    key = (d.code, op.code)
    fn = _reducers.get(key)
    if fn is None:
        fn = _reducers[key] = _make(d, op)
    return fn


def reduce_rows(rows: npt.NDArray[Any], out: npt.NDArray[Any], d: DType, op: ReduceOp) -> None:
    """``out = rows[0] op rows[1] op ...`` (AVG: the sum; the caller divides).

    ``out`` must not overlap ``rows``.
    """
    rows_reducer(d, op)(rows, out)
