"""The slot views a shared-memory (all_)reduce uses, built once per shape and cached by
``ShmGroup``: building them per call cost more than the small rounds themselves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from ...wire.buffers import DType, ReduceOp
from .chunks import plan_chunks
from .reduce import Reducer, rows_reducer

__all__ = ["PLANS", "PipelinePlan", "PipelineRound", "SmallPlan", "pipeline_plan", "small_plan"]

Array = npt.NDArray[Any]
#: a rank's two slots (one per parity)
Slots = Sequence[Sequence[Array]]
#: (rank, parity, byte offset) -> the address of that place in the segment
SlotAt = Callable[[int, int, int], int]


@dataclass(frozen=True, slots=True)
class SmallPlan:
    """The views a one-round (all_)reduce of one (count, dtype, op) uses, made once.

    Why: building them costs more than the round itself (each numpy view ~0.5 us), and a
    training loop repeats the same few shapes."""

    mine: tuple[Array, Array]  #: this rank's slot of each parity, count elements
    mine_at: tuple[int, int]  #: their addresses (``copying``)
    rows: tuple[tuple[Array, ...], tuple[Array, ...]]  #: every rank's, of each parity
    reduce: Reducer
    avg: bool


PLANS = 256  #: cached small plans per group (a program with more shapes rebuilds)

#: one round of a pipelined (all_)reduce: the copies into our slot before publishing
#: (slot view, its address, byte range of the buffer), the part this rank reduces after
#: it (element range of the buffer, every rank's input with ours left to the call, the
#: result's place), and the reduced parts to copy back (byte range, slot view, address)
PipelineRound = tuple[tuple[tuple[Array, int, int, int], ...],
                      tuple[int, int, tuple[Array, ...], Array] | None,
                      tuple[tuple[int, int, Array, int], ...]]


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The slot side of a pipelined (all_)reduce of one (count, dtype, first parity),
    made once: building its views per call cost more than moving 128 KiB (54 us for a
    2-rank 128 KiB all_reduce, of which the data movement is under 10)."""

    rounds: tuple[PipelineRound, ...]


def small_plan(slots: Slots, slot_at: SlotAt, rank: int, size: int, count: int, dtype: DType,
               op: ReduceOp) -> SmallPlan:
    """The views of a one-round (all_)reduce of ``count`` elements."""
    st = dtype.storage
    mine = slots[rank]
    nbytes = count * st.itemsize
    rows = tuple(tuple(slots[r][p][:nbytes].view(st) for r in range(size))
                 for p in (0, 1))
    return SmallPlan((mine[0][:nbytes].view(st), mine[1][:nbytes].view(st)),
                     (slot_at(rank, 0, 0), slot_at(rank, 1, 0)),
                     (rows[0], rows[1]), rows_reducer(dtype, op), op.name == "AVG")


def pipeline_plan(slots: Slots, slot_at: SlotAt, rank: int, size: int, slot_bytes: int,
                  count: int, dtype: DType, p0: int) -> PipelinePlan:
    """The rounds of a pipelined (all_)reduce (see ``ShmGroup._pipelined``)."""
    st = dtype.storage
    n, me = size, rank
    item = st.itemsize
    chunks = plan_chunks(count, item, n, slot_bytes)
    base = chunks.base
    order = [(me + 1 + k) % n for k in range(n)]

    def slot(r: int, p: int, lo: int, hi: int) -> tuple[Array, int]:
        return slots[r][p][lo:hi], slot_at(r, p, lo)

    rounds: list[PipelineRound] = []
    for t in range(chunks.chunks + 1):
        p = (p0 + t) & 1
        sends: list[tuple[Array, int, int, int]] = []
        reduce: tuple[int, int, tuple[Array, ...], Array] | None = None
        gathers: list[tuple[int, int, Array, int]] = []
        if t < chunks.chunks:
            c0, m = chunks.start(t), chunks.length(t)
            lo, hi = chunks.span(t, me)
            for b0, b1 in ((0, lo * item), (hi * item, m * item)):
                if b1 > b0:
                    view, view_at = slot(me, p, base[me] + b0, base[me] + b1)
                    sends.append((view, view_at, c0 * item + b0, c0 * item + b1))
            rows = tuple(
                slots[r][p][base[r] + lo * item:base[r] + hi * item].view(st)
                for r in range(n))
            acc = slots[me][1 - p][base[me] + lo * item:base[me] + hi * item].view(st)
            reduce = (c0 + lo, c0 + hi, rows, acc)
        if t >= 1:
            c0 = chunks.start(t - 1)
            for j in order:
                lo, hi = chunks.span(t - 1, j)
                if hi > lo:
                    view, view_at = slot(j, p, base[j] + lo * item, base[j] + hi * item)
                    gathers.append(((c0 + lo) * item, (c0 + hi) * item, view, view_at))
        rounds.append((tuple(sends), reduce, tuple(gathers)))
    return PipelinePlan(tuple(rounds))
