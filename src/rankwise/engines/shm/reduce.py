"""Reducing the same span of every rank's slot in rank order, one numpy call per rank.

Why rank order: every rank reduces the same inputs in the same sequence
``((r0 op r1) op r2) ...``, so every rank gets the same bits. Why a chain of binary
ufunc calls and not ``ufunc.reduce(axis=0)`` over a strided (ranks, m) view: on a
small all_reduce the per-call costs rule, and a binary call on kept views is ~0.5 us
where the reduce is ~1.2 us (the chain is the same sequence of operations). Float
reductions run under ``wire.quiet`` (inf and nan pass silently, as in torch, whatever
``np.seterr`` says) at ~0.3 us, where ``np.errstate`` costs ~1.5 us. bool and bfloat16
keep going through ``reduce_into``, which knows their special rules.

Why ``rows_reducer``: a small all_reduce runs this once per call, so the choice of ufunc
and of error handling is made once per (dtype, op) and cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...wire.buffers import _UFUNCS, DType, ReduceOp, reduce_into
from ...wire.quiet import call_quietly

__all__ = ["Reducer", "Rows", "reduce_rows", "rows_reducer"]

_BITWISE = frozenset(("BAND", "BOR", "BXOR"))

#: one equal-length 1-D array per rank, or a (ranks, m) view
Rows = Sequence[npt.NDArray[Any]] | npt.NDArray[Any]
#: ``reducer(rows, out)``: ``out = rows[0] op rows[1] op ...`` (see ``reduce_rows``)
Reducer = Callable[[Rows, npt.NDArray[Any]], None]


def _chain(fn: Any, rows: Rows, out: npt.NDArray[Any]) -> None:
    if len(rows) == 1:
        np.copyto(out, rows[0])
        return
    fn(rows[0], rows[1], out=out)
    for r in rows[2:]:
        fn(out, r, out=out)


def _ufunc(op: ReduceOp) -> Any:
    return _UFUNCS[op.name]["int" if op.name in _BITWISE else "num"]


def _make(d: DType, op: ReduceOp) -> Reducer:
    if d.kind in ("float", "complex"):
        fn = _ufunc(op)
        return lambda rows, out: call_quietly(_chain, fn, rows, out)
    if d.kind in ("int", "uint"):
        fn = _ufunc(op)
        return lambda rows, out: _chain(fn, rows, out)

    def one_by_one(rows: Rows, out: npt.NDArray[Any]) -> None:
        np.copyto(out, rows[0])
        for r in rows[1:]:
            reduce_into(out, r, d, op)
    return one_by_one


_reducers: dict[tuple[int, int], Reducer] = {}


def rows_reducer(d: DType, op: ReduceOp) -> Reducer:
    """The reducer for ``d`` and ``op`` (AVG: the sum; the caller divides), cached."""
    key = (d.code, op.code)
    fn = _reducers.get(key)
    if fn is None:
        fn = _reducers[key] = _make(d, op)
    return fn


def reduce_rows(rows: Rows, out: npt.NDArray[Any], d: DType, op: ReduceOp) -> None:
    """``out = rows[0] op rows[1] op ...`` (AVG: the sum; the caller divides).

    ``out`` must not overlap ``rows``.
    """
    rows_reducer(d, op)(rows, out)
