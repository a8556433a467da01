"""Random differential cases: each rank runs the same call on rankwise and on torch gloo.

Why this shape: a rank process initializes BOTH libraries (rankwise over its own port, torch
gloo over a second one), then walks one seeded list of cases that every rank derives from
the same seed. Inputs come from ``np.random.default_rng((seed, case, rank, slot))``, so any
rank can regenerate any other rank's input. That gives two oracles:

* torch gloo, run on the very same input tensors, where gloo supports the dtype/op
  (probed on torch 2.13: gloo moves and reduces float32/64/16, bfloat16, int8/32/64, uint8
  and bool; it raises for int16, uint16/32/64, float8 and complex gathers, and has no AVG);
* otherwise a numpy reference model computed from every rank's regenerated input.

A gloo error is asynchronous and poisons the whole gloo group, so the choice of oracle is
a static table (``gloo_ok``) rather than try/except. Each rank compares locally and
returns only a short summary (mismatch strings, digests of all_reduce results for the
cross-rank bit-identity check), which keeps the result queue small.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as td

import rankwise as rw
from rankwise.algorithms import ring as rw_ring
from rankwise.core import messages as rw_message

# --- dtypes and ops ------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
#: dtypes torch 2.13's gloo backend moves and reduces (see the module docstring)
GLOO_DTYPES = {"float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8",
               "bool"}
FLOATS = {"float32", "float64", "float16", "bfloat16"}
INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
COMPLEX = {"complex64", "complex128"}
OPAQUE = {"float8_e4m3fn", "float8_e5m2"}
#: unit roundoff-ish per dtype, for float tolerances
EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "float16": 2.0 ** -10,
       "bfloat16": 2.0 ** -7, "complex64": 2.0 ** -23, "complex128": 2.0 ** -52}
#: dtypes numpy has natively: their cases may hand rankwise numpy arrays instead of tensors
NUMPY_NATIVE = {"float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
                "uint16", "uint32", "uint64", "bool", "complex64", "complex128"}


def valid_ops(dtype: str) -> list[str]:
    """The reduce ops rankwise defines for ``dtype`` (the same table as torch's)."""
    if dtype in FLOATS:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    if dtype in INTS or dtype == "bool":
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype in COMPLEX:
        return ["SUM", "AVG", "PRODUCT"]
    return []


REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
MOVING = {"broadcast", "scatter", "gather", "all_gather", "all_gather_into_tensor",
          "all_to_all", "all_to_all_single", "send_recv", "recv_any", "isend_irecv",
          "batch_isend_irecv"}
OBJECTS = {"broadcast_object_list", "all_gather_object", "gather_object",
           "scatter_object_list", "send_object_list"}
ALL_OPS = sorted(REDUCING | MOVING | OBJECTS | {"barrier"})
P2P = {"send_recv", "recv_any", "isend_irecv", "batch_isend_irecv", "send_object_list"}


def gloo_ok(case: Case) -> bool:
    """Whether torch gloo can serve as the oracle for ``case`` without raising."""
    if case.op in OBJECTS or case.op == "barrier":
        return True
    if case.dtype not in GLOO_DTYPES or case.reduce_op == "AVG":
        return False
    if case.op == "all_to_all":  # gloo implements only the single-tensor all_to_all
        return False
    if case.splits is not None:  # decided from the shared split matrix: same on every rank
        return all(sum(row) for row in case.splits) and \
            all(sum(col) for col in zip(*case.splits))
    if case.op in ("reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor") \
            and not case.shape:
        return False  # gloo rejects 0-d here, and segfaults on a 0-d reduce_scatter output
    # empty tensors: gloo's behaviour varies by op and a raise would poison the group
    return case.numel > 0


# --- cases ---------------------------------------------------------------------------------

@dataclass
class Case:
    """One call, identical on every rank; ``index`` also seeds the inputs."""

    index: int
    op: str
    dtype: str = "float32"
    shape: tuple[int, ...] = (4,)
    reduce_op: str | None = None
    group: int = 0  #: index into ``group_ranks(ws)``
    root: int = 0  #: a GLOBAL rank, as torch's src/dst arguments are
    peers: tuple[int, ...] = ()  #: p2p: (src, dst) or (receiver,) for recv_any
    tag: int = 0
    async_op: bool = False
    use_numpy: bool = False  #: hand rankwise numpy arrays instead of torch tensors
    splits: list[list[int]] | None = None  #: all_to_all_single: rows rank i sends rank j
    ring_threshold: int | None = None  #: rankwise-only override to force an algorithm
    segment_bytes: int | None = None  #: rankwise-only override of the ring segment size
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def describe(self) -> str:
        bits = [f"#{self.index} {self.op}", self.dtype, f"shape={self.shape}"]
        if self.reduce_op:
            bits.append(self.reduce_op)
        bits.append(f"group={self.group}")
        if self.op in ("broadcast", "scatter", "reduce", "gather", "broadcast_object_list",
                       "gather_object", "scatter_object_list"):
            bits.append(f"root={self.root}")
        if self.peers:
            bits.append(f"peers={self.peers} tag={self.tag}")
        if self.async_op:
            bits.append("async")
        if self.use_numpy:
            bits.append("numpy")
        if self.splits is not None:
            bits.append(f"splits={self.splits}")
        if self.ring_threshold is not None:
            bits.append(f"ring_threshold={self.ring_threshold}")
        if self.segment_bytes is not None:
            bits.append(f"segment_bytes={self.segment_bytes}")
        return " ".join(bits)


def group_ranks(ws: int) -> list[list[int]]:
    """The groups every case may use: WORLD first, then subgroups created in this order.

    One is given unsorted on purpose: torch sorts ``new_group`` ranks, so group rank order
    (scatter/gather list order) must follow the sorted list in rankwise as well.
    """
    groups = [list(range(ws))]
    if ws >= 2:
        groups.append([ws - 1, 0])  # unsorted; a pair
    if ws >= 3:
        groups.append(list(range(1, ws)))
        groups.append([0, ws - 1] if ws > 3 else [2])  # a singleton group at ws 3
    if ws >= 5:
        groups.append([4, 1, 3])
    return groups


_SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (2,), (3,), (5,), (7,), (13,), (2, 3),
                                  (4, 5), (3, 0), (31,), (64,), (2, 3, 4), (101,), (257,),
                                  (1000,)]


def make_cases(seed: int, ws: int, n: int) -> list[Case]:
    """``n`` random cases plus fixed ones for the algorithm regimes, all from ``seed``."""
    rnd = random.Random(seed)
    groups = group_ranks(ws)
    cases: list[Case] = []

    def add(**kw: Any) -> None:
        cases.append(Case(index=len(cases), **kw))

    # the all_reduce regimes, deterministic so every run covers them
    for dtype, count in [("float32", 70_001), ("bfloat16", 150_001), ("int32", 65_537),
                         ("float64", 40_003), ("float32", 600_007)]:
        add(op="all_reduce", dtype=dtype, shape=(count,), reduce_op="SUM")
    for count in sorted({1, max(1, ws - 1), ws, ws + 1, 2 * ws - 1, 3 * ws + 2, 97}):
        for rop in ("SUM", "MAX"):
            add(op="all_reduce", dtype="float32" if rop == "SUM" else "int64",
                shape=(count,), reduce_op=rop, ring_threshold=0, segment_bytes=8)
    add(op="all_reduce", dtype="float16", shape=(12_345,), reduce_op="SUM", ring_threshold=0,
        segment_bytes=4096)
    add(op="reduce_scatter_tensor", dtype="float32", shape=(40_001,), reduce_op="SUM",
        segment_bytes=4096)
    add(op="all_gather_into_tensor", dtype="float64", shape=(30_011,), segment_bytes=8192)

    while len(cases) < n:
        op = rnd.choice(ALL_OPS)
        gi = rnd.randrange(len(groups))
        members = sorted(groups[gi])
        if op in P2P and len(members) < 2:
            continue
        dtype = rnd.choice(sorted(DTYPES))
        reduce_op = None
        if op in REDUCING:
            ops = valid_ops(dtype)
            if not ops:
                continue
            reduce_op = rnd.choice(ops)
        shape = rnd.choice(_SHAPES)
        splits = None
        if op in ("all_to_all_single",):
            if rnd.random() < 0.5:
                splits = [[rnd.randrange(0, 4) for _ in members] for _ in members]
                rest = rnd.choice([(), (3,), (2, 2)])
                shape = rest  # per-row shape; rows come from the split matrix
            else:
                rows = len(members) * rnd.randrange(0, 4)
                shape = (rows,) + rnd.choice([(), (3,)])
        ring = None
        if op in ("all_reduce",) and rnd.random() < 0.3:
            ring = 0  # small data through the ring as well
        use_numpy = dtype in NUMPY_NATIVE and rnd.random() < 0.25 and op not in OBJECTS
        peers: tuple[int, ...] = ()
        if op in ("send_recv", "send_object_list"):
            peers = tuple(rnd.sample(members, 2))
        elif op == "recv_any":
            peers = (rnd.choice(members),)
        add(op=op, dtype=dtype, shape=shape, reduce_op=reduce_op, group=gi,
            root=rnd.choice(members), peers=peers, tag=rnd.choice([0, 0, 1, 7, 12345]),
            async_op=rnd.random() < 0.3 and op not in OBJECTS and op not in P2P,
            use_numpy=use_numpy, splits=splits, ring_threshold=ring,
            extra={"obj_seed": rnd.randrange(1 << 30)})
    return cases


# --- inputs --------------------------------------------------------------------------------

def make_input(seed: int, case: Case, rank: int, slot: int = 0,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank ``rank``'s input number ``slot`` for ``case``; any rank can regenerate it."""
    shape = case.shape if shape is None else shape
    rng = np.random.default_rng([seed, case.index, rank, slot])
    n = int(np.prod(shape)) if shape else 1
    d, op = case.dtype, case.reduce_op
    if d in FLOATS:
        if op == "PRODUCT":
            vals = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)
        else:
            vals = rng.standard_normal(n) * (4.0 if d in ("float16", "bfloat16") else 100.0)
        t = torch.from_numpy(vals).to(DTYPES[d])
    elif d in COMPLEX:
        scale = 1.0 if op == "PRODUCT" else 10.0
        vals = (rng.standard_normal(n) + 1j * rng.standard_normal(n)) * scale
        t = torch.from_numpy(vals.astype(np.complex128)).to(DTYPES[d])
    elif d == "bool":
        t = torch.from_numpy(rng.random(n) < 0.5)
    elif d in INTS:
        info = np.iinfo(np.dtype(d))
        if op == "PRODUCT":
            lo, hi = (-3, 3) if info.min < 0 else (0, 3)
        elif op in ("SUM", "AVG"):
            lo, hi = max(int(info.min), -1000), min(int(info.max), 1000)
        else:  # movement, min/max and bitwise ops: the full range
            lo, hi = int(info.min), int(info.max)
        vals = rng.integers(lo, hi, n, dtype=np.dtype(d), endpoint=True)
        t = _from_numpy(vals, d)
    else:  # float8: arbitrary bit patterns (NaNs included); data movement only
        bits = rng.integers(0, 256, n, dtype=np.uint8)
        t = torch.from_numpy(bits).view(DTYPES[d])
    return t.reshape(shape).contiguous()


def _from_numpy(vals: np.ndarray[Any, Any], d: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(vals)).to(DTYPES[d])


def empty_like(case: Case, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An output tensor filled with a sentinel, so an unwritten result shows up."""
    shape = case.shape if shape is None else shape
    dtype = DTYPES[case.dtype]
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.full((n * size,), 0xA5, dtype=torch.uint8).view(dtype).reshape(shape)


def to_rw(case: Case, t: torch.Tensor) -> Any:
    """What rankwise gets: the tensor itself, or a numpy array sharing its memory."""
    return t.numpy() if case.use_numpy else t


# --- comparison ----------------------------------------------------------------------------

def raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(raw_bytes(t), usedforsecurity=False).hexdigest()[:16]


def _numeric(t: torch.Tensor) -> np.ndarray[Any, Any]:
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.to(torch.float64).numpy()
    return t.numpy()


def compare(case: Case, what: str, got: torch.Tensor, want: torch.Tensor,
            tol: np.ndarray[Any, Any] | None = None) -> list[str]:
    """Empty list when equal: bytes for exact cases, ``|got - want| <= tol`` for floats."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return [(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}"
                 f"{tuple(want.shape)}")]
    if tol is None:
        if raw_bytes(got) == raw_bytes(want):
            return []
        g, w = got.reshape(-1), want.reshape(-1)
        gb = g.view(torch.uint8).reshape(g.numel(), -1) if g.numel() else g
        wb = w.view(torch.uint8).reshape(w.numel(), -1) if w.numel() else w
        bad = [i for i in range(g.numel()) if not torch.equal(gb[i], wb[i])]
        return [(f"{what}: {len(bad)}/{g.numel()} elements differ; first at {bad[0]}: "
                 f"got {g[bad[0]].item()!r}, want {w[bad[0]].item()!r}")]
    g, w = _numeric(got).reshape(-1), _numeric(want).reshape(-1)
    err = np.abs(g.astype(np.complex128) - w.astype(np.complex128))
    bad = np.flatnonzero(~(err <= tol.reshape(-1)))
    if not bad.size:
        return []
    i = int(bad[0])
    return [(f"{what}: {bad.size}/{g.size} elements beyond tolerance; first at {i}: got "
             f"{g[i]!r}, want {w[i]!r}, tolerance {tol.reshape(-1)[i]:.3g}")]


_NP_REDUCE: dict[str, Callable[..., Any]] = {
    "SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
    "MAX": np.maximum, "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}
_BOOL_REDUCE: dict[str, Callable[..., Any]] = {
    "SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and,
    "MAX": np.logical_or, "BAND": np.logical_and, "BOR": np.logical_or,
    "BXOR": np.logical_xor,
}


def reference_reduce(case: Case, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The numpy model of a reduction over ``inputs`` (in rank order).

    Integers wrap in their own dtype, as torch's kernels do; floats and complex go
    through float64/complex128 and are compared within a tolerance (``tolerance``).
    """
    d, op = case.dtype, case.reduce_op
    assert op is not None
    if d == "bool":
        acc = inputs[0].numpy().copy()
        for t in inputs[1:]:
            acc = _BOOL_REDUCE[op](acc, t.numpy())
        return torch.from_numpy(np.ascontiguousarray(acc))
    if d in INTS:
        acc = inputs[0].numpy().copy()
        for t in inputs[1:]:
            acc = _NP_REDUCE[op](acc, t.numpy()).astype(acc.dtype)
        return _from_numpy(acc, d).reshape(inputs[0].shape)
    wide = [(t.to(torch.complex128) if d in COMPLEX else t.to(torch.float64)).numpy()
            for t in inputs]
    acc = wide[0].copy()
    for a in wide[1:]:
        acc = _NP_REDUCE[op](acc, a)
    if op == "AVG":
        acc = acc / len(inputs)
    return torch.from_numpy(np.ascontiguousarray(acc)).to(DTYPES[d]).reshape(inputs[0].shape)


def tolerance(case: Case, inputs: list[torch.Tensor]) -> np.ndarray[Any, Any] | None:
    """None (exact) for ints, bool, MIN and MAX; else a per-element rounding bound.

    The bound allows a few roundings per partial sum: summation order differs between
    libraries and between algorithms, and half-precision types round every step.
    """
    d, op = case.dtype, case.reduce_op
    if d not in FLOATS and d not in COMPLEX or op in ("MIN", "MAX"):
        return None
    mags = [np.abs(_numeric(t).astype(np.complex128)).reshape(-1) for t in inputs]
    if op == "PRODUCT":
        mag = np.prod(mags, axis=0) if mags else np.zeros(0)
    else:
        mag = np.sum(mags, axis=0) if mags else np.zeros(0)
        if op == "AVG":
            mag = mag / len(inputs)
    steps = len(inputs) + 2
    return 4.0 * EPS[d] * steps * mag + np.finfo(np.float64).tiny


# --- running one case ----------------------------------------------------------------------

@dataclass
class Ctx:
    """What a case needs on this rank: both libraries' groups and the shared seed."""

    seed: int
    rank: int
    ws: int
    rw_groups: list[Any]
    td_groups: list[Any]
    members: list[list[int]]
    mismatches: list[str] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    oracle_gloo: int = 0
    oracle_model: int = 0


def _wait(w: Any) -> None:
    if w is not None:
        w.wait()


def run_case(ctx: Ctx, case: Case) -> None:
    """Run ``case`` on both libraries (or rankwise and the model) and record differences."""
    members = sorted(ctx.members[case.group])
    if ctx.rank not in members:
        if case.op == "all_reduce":  # a non-member's call returns at once, data untouched
            t = make_input(ctx.seed, case, ctx.rank)
            work = rw.all_reduce(t, group=_rw_group(ctx, case), async_op=case.async_op)
            if work is not None or not torch.equal(t, make_input(ctx.seed, case, ctx.rank)):
                ctx.mismatches.append(f"rank {ctx.rank}: {case.describe()}: a non-member's "
                                      f"call returned {work!r} or changed its tensor")
        return
    old = rw_message.RING_THRESHOLD, rw_ring.SEGMENT_BYTES
    if case.ring_threshold is not None:
        rw_message.RING_THRESHOLD = case.ring_threshold
    if case.segment_bytes is not None:
        rw_ring.SEGMENT_BYTES = case.segment_bytes
    try:
        use_gloo = gloo_ok(case)
        if use_gloo:
            ctx.oracle_gloo += 1
        else:
            ctx.oracle_model += 1
        problems = _RUNNERS[case.op](ctx, case, members, use_gloo)
    finally:
        rw_message.RING_THRESHOLD, rw_ring.SEGMENT_BYTES = old
    oracle = "gloo" if use_gloo else "model"
    ctx.mismatches.extend(f"rank {ctx.rank}: {case.describe()} [oracle {oracle}]: {p}"
                          for p in problems)


def _rw_group(ctx: Ctx, case: Case) -> Any:
    return ctx.rw_groups[case.group]


def _td_group(ctx: Ctx, case: Case) -> Any:
    return ctx.td_groups[case.group]


def stacked(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """``n`` tensors of ``shape`` stacked along dim 0, as torch's *_tensor collectives want."""
    return (n * shape[0],) + shape[1:] if shape else (n,)


def _all_reduce(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    mine = make_input(ctx.seed, case, ctx.rank)
    out = mine.clone()
    _wait(rw.all_reduce(to_rw(case, out), op=getattr(rw.ReduceOp, case.reduce_op or "SUM"),
                        group=_rw_group(ctx, case), async_op=case.async_op))
    ctx.digests[case.index] = digest(out)
    inputs = [make_input(ctx.seed, case, r) for r in members]
    want = _oracle_reduce(ctx, case, mine, inputs, gloo, lambda t, op, g:
                          td.all_reduce(t, op=op, group=g))
    return compare(case, "all_reduce", out, want, tolerance(case, inputs))


def _oracle_reduce(ctx: Ctx, case: Case, mine: torch.Tensor, inputs: list[torch.Tensor],
                   gloo: bool, call: Callable[[torch.Tensor, Any, Any], Any]) -> torch.Tensor:
    if not gloo:
        return reference_reduce(case, inputs)
    t = mine.clone()
    call(t, getattr(td.ReduceOp, case.reduce_op or "SUM"), _td_group(ctx, case))
    return t


def _reduce(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    mine = make_input(ctx.seed, case, ctx.rank)
    out = mine.clone()
    _wait(rw.reduce(to_rw(case, out), dst=case.root,
                    op=getattr(rw.ReduceOp, case.reduce_op or "SUM"),
                    group=_rw_group(ctx, case), async_op=case.async_op))
    inputs = [make_input(ctx.seed, case, r) for r in members]
    want = _oracle_reduce(ctx, case, mine, inputs, gloo, lambda t, op, g:
                          td.reduce(t, dst=case.root, op=op, group=g))
    if ctx.rank != case.root:
        return []  # torch leaves non-root buffers unspecified
    return compare(case, "reduce", out, want, tolerance(case, inputs))


def _reduce_scatter(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    n, me = len(members), members.index(ctx.rank)
    single = case.op == "reduce_scatter_tensor"
    big = stacked(case.shape, n)

    def ins(r: int) -> list[torch.Tensor]:
        if single:
            return list(make_input(ctx.seed, case, r, 0, big).reshape(n, case.numel).unbind(0))
        return [make_input(ctx.seed, case, r, j) for j in range(n)]

    mine = ins(ctx.rank)
    out = empty_like(case)
    group = _rw_group(ctx, case)
    rop = getattr(rw.ReduceOp, case.reduce_op or "SUM")
    if single:
        flat = make_input(ctx.seed, case, ctx.rank, 0, big)
        _wait(rw.reduce_scatter_tensor(to_rw(case, out), to_rw(case, flat), op=rop, group=group,
                                       async_op=case.async_op))
    else:
        _wait(rw.reduce_scatter(to_rw(case, out), [to_rw(case, t) for t in mine], op=rop,
                                group=group, async_op=case.async_op))
    column = [ins(r)[me].reshape(case.shape) for r in members]
    if gloo:
        want = empty_like(case)
        top = getattr(td.ReduceOp, case.reduce_op or "SUM")
        if single:
            td.reduce_scatter_tensor(want, make_input(ctx.seed, case, ctx.rank, 0, big),
                                     op=top, group=_td_group(ctx, case))
        else:
            td.reduce_scatter(want, [t.clone() for t in mine], op=top,
                              group=_td_group(ctx, case))
    else:
        want = reference_reduce(case, column)
    return compare(case, case.op, out, want, tolerance(case, column))


def _broadcast(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    out = make_input(ctx.seed, case, ctx.rank)
    _wait(rw.broadcast(to_rw(case, out), src=case.root, group=_rw_group(ctx, case),
                       async_op=case.async_op))
    if gloo:
        want = make_input(ctx.seed, case, ctx.rank)
        td.broadcast(want, src=case.root, group=_td_group(ctx, case))
    else:
        want = make_input(ctx.seed, case, case.root)
    return compare(case, "broadcast", out, want)


def _scatter(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    is_root = ctx.rank == case.root
    chunks = [make_input(ctx.seed, case, case.root, j) for j in range(len(members))]
    out = empty_like(case)
    _wait(rw.scatter(to_rw(case, out), [to_rw(case, c) for c in chunks] if is_root else None,
                     src=case.root, group=_rw_group(ctx, case), async_op=case.async_op))
    if gloo:
        want = empty_like(case)
        td.scatter(want, [c.clone() for c in chunks] if is_root else None, src=case.root,
                   group=_td_group(ctx, case))
    else:
        want = chunks[members.index(ctx.rank)]
    return compare(case, "scatter", out, want)


def _gather(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    is_root = ctx.rank == case.root
    mine = make_input(ctx.seed, case, ctx.rank)
    outs = [empty_like(case) for _ in members] if is_root else None
    _wait(rw.gather(to_rw(case, mine), [to_rw(case, o) for o in outs] if outs else None,
                    dst=case.root, group=_rw_group(ctx, case), async_op=case.async_op))
    if gloo:
        wants = [empty_like(case) for _ in members] if is_root else None
        td.gather(mine.clone(), wants, dst=case.root, group=_td_group(ctx, case))
    else:
        wants = [make_input(ctx.seed, case, r) for r in members] if is_root else None
    if not is_root:
        return []
    assert outs is not None and wants is not None
    return [p for i, (o, w) in enumerate(zip(outs, wants))
            for p in compare(case, f"gather_list[{i}]", o, w)]


def _all_gather(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    mine = make_input(ctx.seed, case, ctx.rank)
    n = len(members)
    if case.op == "all_gather_into_tensor":
        # torch wants the output stacked along dim 0 (flat for 0-d inputs)
        big = stacked(case.shape, n)
        out = empty_like(case, big)
        _wait(rw.all_gather_into_tensor(to_rw(case, out), to_rw(case, mine),
                                        group=_rw_group(ctx, case), async_op=case.async_op))
        if gloo:
            want = empty_like(case, big)
            td.all_gather_into_tensor(want, mine.clone(), group=_td_group(ctx, case))
        else:
            want = torch.cat([make_input(ctx.seed, case, r).reshape(-1)
                              for r in members]).reshape(big)
        ctx.digests[case.index] = digest(out)
        return compare(case, "all_gather_into_tensor", out, want)
    outs = [empty_like(case) for _ in members]
    _wait(rw.all_gather([to_rw(case, o) for o in outs], to_rw(case, mine),
                        group=_rw_group(ctx, case), async_op=case.async_op))
    if gloo:
        wants = [empty_like(case) for _ in members]
        td.all_gather(wants, mine.clone(), group=_td_group(ctx, case))
    else:
        wants = [make_input(ctx.seed, case, r) for r in members]
    return [p for i, (o, w) in enumerate(zip(outs, wants))
            for p in compare(case, f"tensor_list[{i}]", o, w)]


def _all_to_all(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    me = members.index(ctx.rank)
    ins = [make_input(ctx.seed, case, ctx.rank, j) for j in range(len(members))]
    outs = [empty_like(case) for _ in members]
    _wait(rw.all_to_all([to_rw(case, o) for o in outs], [to_rw(case, t) for t in ins],
                        group=_rw_group(ctx, case), async_op=case.async_op))
    wants = [make_input(ctx.seed, case, r, me) for r in members]
    return [p for i, (o, w) in enumerate(zip(outs, wants))
            for p in compare(case, f"output_tensor_list[{i}]", o, w)]


def _all_to_all_single(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    n, me = len(members), members.index(ctx.rank)
    if case.splits is not None:
        rest = case.shape
        in_splits = case.splits[me]
        out_splits = [case.splits[j][me] for j in range(n)]

        def inp(r: int) -> torch.Tensor:
            rows = sum(case.splits[members.index(r)])  # type: ignore[index]
            return make_input(ctx.seed, case, r, 0, (rows,) + rest)

        out_shape = (sum(out_splits),) + rest
    else:
        rest = case.shape[1:]
        in_splits = out_splits = None  # type: ignore[assignment]

        def inp(r: int) -> torch.Tensor:
            return make_input(ctx.seed, case, r)

        out_shape = case.shape
    mine = inp(ctx.rank)
    out = empty_like(case, out_shape)
    _wait(rw.all_to_all_single(to_rw(case, out), to_rw(case, mine), out_splits, in_splits,
                               group=_rw_group(ctx, case), async_op=case.async_op))
    if gloo:
        want = empty_like(case, out_shape)
        td.all_to_all_single(want, mine.clone(), out_splits, in_splits,
                             group=_td_group(ctx, case))
    else:
        pieces = []
        for j, r in enumerate(members):
            src = inp(r)
            sizes = case.splits[j] if case.splits is not None else [src.shape[0] // n] * n
            start = sum(sizes[:me])
            pieces.append(src[start:start + sizes[me]])
        want = torch.cat(pieces) if pieces else empty_like(case, out_shape)
        want = want.reshape(out_shape)
    return compare(case, "all_to_all_single", out, want)


def _barrier(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    _wait(rw.barrier(group=_rw_group(ctx, case), async_op=case.async_op))
    td.barrier(group=_td_group(ctx, case))
    return []


def _send_recv(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    src, dst = case.peers
    if ctx.rank not in (src, dst):
        return []
    data = make_input(ctx.seed, case, src)
    problems: list[str] = []
    for lib, group, enabled in ((rw, _rw_group(ctx, case), True),
                                (td, _td_group(ctx, case), gloo)):
        if not enabled:
            continue
        if ctx.rank == src:
            lib.send(to_rw(case, data) if lib is rw else data, dst=dst, group=group,
                     tag=case.tag)
        else:
            got = empty_like(case)
            sender = lib.recv(to_rw(case, got) if lib is rw else got, src=src, group=group,
                              tag=case.tag)
            name = "rankwise" if lib is rw else "gloo"
            problems += compare(case, f"{name} recv", got, data)
            if sender != src:
                problems.append(f"{name} recv returned sender {sender}, want {src}")
    return problems


def _recv_any(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    """Every other member sends to one receiver, which takes them with ``src=None``."""
    (receiver,) = case.peers
    others = [r for r in members if r != receiver]
    problems: list[str] = []
    for lib, group, enabled in ((rw, _rw_group(ctx, case), True),
                                (td, _td_group(ctx, case), gloo)):
        if not enabled:
            continue
        name = "rankwise" if lib is rw else "gloo"
        if ctx.rank != receiver:
            data = make_input(ctx.seed, case, ctx.rank)
            lib.send(to_rw(case, data) if lib is rw else data, dst=receiver, group=group,
                     tag=case.tag)
            continue
        seen = []
        for _ in others:
            got = empty_like(case)
            sender = lib.recv(to_rw(case, got) if lib is rw else got, src=None, group=group,
                              tag=case.tag)
            seen.append(sender)
            if sender in others:
                problems += compare(case, f"{name} recv(src=None) from {sender}", got,
                                    make_input(ctx.seed, case, sender))
        if sorted(seen) != others:
            problems.append(f"{name} recv(src=None) senders {seen}, want each of {others}")
        # gloo and rankwise both need the round finished before the other library starts
    return problems


def _ring_exchange(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    """Each member sends to the next and receives from the previous, non-blocking."""
    n, me = len(members), members.index(ctx.rank)
    nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
    mine = make_input(ctx.seed, case, ctx.rank)
    want = make_input(ctx.seed, case, prv)
    problems: list[str] = []
    batch = case.op == "batch_isend_irecv"
    for lib, group, enabled in ((rw, _rw_group(ctx, case), True),
                                (td, _td_group(ctx, case), gloo)):
        if not enabled:
            continue
        name = "rankwise" if lib is rw else "gloo"
        got = empty_like(case)
        a = to_rw(case, got) if lib is rw else got
        b = to_rw(case, mine) if lib is rw else mine
        if batch:
            ops = [lib.P2POp(lib.irecv, a, prv, group, case.tag),
                   lib.P2POp(lib.isend, b, nxt, group, case.tag)]
            if (case.index + ctx.rank) % 2:
                ops.reverse()
            works = lib.batch_isend_irecv(ops)
        elif me % 2:
            works = [lib.irecv(a, src=prv, group=group, tag=case.tag),
                     lib.isend(b, dst=nxt, group=group, tag=case.tag)]
        else:
            works = [lib.isend(b, dst=nxt, group=group, tag=case.tag),
                     lib.irecv(a, src=prv, group=group, tag=case.tag)]
        for w in works:
            w.wait()
        problems += compare(case, f"{name} {case.op}", got, want)
    return problems


# --- object collectives ---------------------------------------------------------------------

def make_object(seed: int, case: Case, rank: int, slot: int = 0) -> Any:
    """Random plain data of the kinds the safe serializer carries (no pickle needed)."""
    rnd = random.Random(f"{seed}/{case.index}/{rank}/{slot}")

    def leaf() -> Any:
        kind = rnd.randrange(9)
        if kind == 0:
            return None
        if kind == 1:
            return rnd.random() < 0.5
        if kind == 2:
            return rnd.randrange(-(1 << 70), 1 << 70)
        if kind == 3:
            return rnd.uniform(-1e9, 1e9)
        if kind == 4:
            return "".join(rnd.choice("abcé€𝄞 \n\x00") for _ in range(rnd.randrange(12)))
        if kind == 5:
            return bytes(rnd.randrange(256) for _ in range(rnd.randrange(10)))
        if kind == 6:
            return np.arange(rnd.randrange(5), dtype=rnd.choice(["int32", "float64"]))
        if kind == 7:
            return torch.arange(rnd.randrange(5), dtype=torch.float32) * rnd.random()
        return complex(rnd.random(), -rnd.random())

    def node(depth: int) -> Any:
        if depth > 2 or rnd.random() < 0.4:
            return leaf()
        kind = rnd.randrange(3)
        items = [node(depth + 1) for _ in range(rnd.randrange(4))]
        if kind == 0:
            return items
        if kind == 1:
            return tuple(items)
        return {rnd.choice([f"k{i}", i]): v for i, v in enumerate(items)}

    return node(0)


def same_object(a: Any, b: Any) -> bool:
    """Structural equality that also holds for arrays and tensors (type included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_object(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_object(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _objects(ctx: Ctx, case: Case, members: list[int], gloo: bool) -> list[str]:
    """Run the object collective on both libraries; gloo's (pickle) result is the oracle."""
    n, me = len(members), members.index(ctx.rank)
    rg, tg = _rw_group(ctx, case), _td_group(ctx, case)
    mine = make_object(ctx.seed, case, ctx.rank)
    problems: list[str] = []

    def check(what: str, got: Any, want: Any, model: Any) -> None:
        if not same_object(got, want):
            problems.append(f"{what}: rankwise {got!r} != gloo {want!r}")
        if not same_object(got, model):
            problems.append(f"{what}: rankwise {got!r} != model {model!r}")

    if case.op == "broadcast_object_list":
        k = 1 + case.index % 3
        src_list = [make_object(ctx.seed, case, case.root, j) for j in range(k)]
        a = src_list if ctx.rank == case.root else [None] * k
        b = [make_object(ctx.seed, case, case.root, j) for j in range(k)] \
            if ctx.rank == case.root else [None] * k
        rw.broadcast_object_list(a, src=case.root, group=rg)
        td.broadcast_object_list(b, src=case.root, group=tg)
        check("broadcast_object_list", a, b, src_list)
    elif case.op == "all_gather_object":
        a: list[Any] = [None] * n
        b: list[Any] = [None] * n
        rw.all_gather_object(a, mine, group=rg)
        td.all_gather_object(b, make_object(ctx.seed, case, ctx.rank), group=tg)
        check("all_gather_object", a, b,
              [make_object(ctx.seed, case, r) for r in members])
    elif case.op == "gather_object":
        is_root = ctx.rank == case.root
        a = [None] * n if is_root else None  # type: ignore[assignment]
        b = [None] * n if is_root else None  # type: ignore[assignment]
        rw.gather_object(mine, a, dst=case.root, group=rg)
        td.gather_object(make_object(ctx.seed, case, ctx.rank), b, dst=case.root, group=tg)
        if is_root:
            check("gather_object", a, b, [make_object(ctx.seed, case, r) for r in members])
    elif case.op == "scatter_object_list":
        is_root = ctx.rank == case.root
        items = [make_object(ctx.seed, case, case.root, j) for j in range(n)]
        a, b = [None], [None]
        rw.scatter_object_list(a, items if is_root else None, src=case.root, group=rg)
        td.scatter_object_list(b, [make_object(ctx.seed, case, case.root, j) for j in range(n)]
                               if is_root else None, src=case.root, group=tg)
        check("scatter_object_list", a[0], b[0], items[me])
    elif case.op == "send_object_list":
        src, dst = case.peers
        k = 1 + case.index % 3
        sent = [make_object(ctx.seed, case, src, j) for j in range(k)]
        if ctx.rank == src:
            rw.send_object_list(sent, dst=dst, group=rg)
            td.send_object_list([make_object(ctx.seed, case, src, j) for j in range(k)],
                                dst=dst, group=tg)
        elif ctx.rank == dst:
            a, b = [None] * k, [None] * k
            rw.recv_object_list(a, src=src, group=rg)
            td.recv_object_list(b, src=src, group=tg)
            check("recv_object_list", a, b, sent)
    return problems


_RUNNERS: dict[str, Callable[[Ctx, Case, list[int], bool], list[str]]] = {
    "all_reduce": _all_reduce, "reduce": _reduce, "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter, "broadcast": _broadcast, "scatter": _scatter,
    "gather": _gather, "all_gather": _all_gather, "all_gather_into_tensor": _all_gather,
    "all_to_all": _all_to_all, "all_to_all_single": _all_to_all_single, "barrier": _barrier,
    "send_recv": _send_recv, "recv_any": _recv_any, "isend_irecv": _ring_exchange,
    "batch_isend_irecv": _ring_exchange, "broadcast_object_list": _objects,
    "all_gather_object": _objects, "gather_object": _objects,
    "scatter_object_list": _objects, "send_object_list": _objects,
}


# --- the per-rank entry point -----------------------------------------------------------------

def differential_worker(rank: int, ws: int, seed: int, n_cases: int, torch_port: int,
                        skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run every case of ``make_cases(seed, ws, n_cases)`` on both libraries.

    rankwise is already initialized by ``run_ranks``; torch gloo is initialized here on
    ``torch_port``. ``skip`` names case predicates (see ``SKIPS``) for filed bugs.
    Returns a summary: counts, mismatch strings, all_reduce digests.
    """
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                          world_size=ws)
    try:
        members = group_ranks(ws)
        rw_groups: list[Any] = [None]
        td_groups: list[Any] = [None]
        for ranks in members[1:]:
            rw_groups.append(rw.new_group(ranks))
            td_groups.append(td.new_group(ranks))
        ctx = Ctx(seed, rank, ws, rw_groups, td_groups, members)
        ran: dict[str, int] = {}
        trace = os.environ.get("RANKWISE_DIFF_TRACE") == "1"  # which case crashed a rank
        cases = make_cases(seed, ws, n_cases)
        for case in cases:
            if any(s == f"op:{case.op}" or (s in SKIPS and SKIPS[s](case)) for s in skip):
                continue
            if trace:
                print(f"rank {rank}: {case.describe()}", file=sys.stderr, flush=True)
            try:
                run_case(ctx, case)
            except Exception as exc:
                raise RuntimeError(f"seed {seed}, world size {ws}, rank {rank}: "
                                   f"{case.describe()} raised {type(exc).__name__}: {exc}") \
                    from exc
            ran[case.op] = ran.get(case.op, 0) + 1
        td.barrier()
        return {"ran": ran, "cases": len(cases), "mismatches": ctx.mismatches,
                "digests": ctx.digests, "gloo": ctx.oracle_gloo, "model": ctx.oracle_model}
    finally:
        td.destroy_process_group()


#: predicates that keep cases hitting a filed bug (BUGS.md) out of the main run
SKIPS: dict[str, Callable[[Case], bool]] = {}


# --- targeted repros for filed bugs ----------------------------------------------------------

def cross_group_p2p(rank: int, ws: int, torch_port: int) -> dict[str, Any]:
    """Same (peer, tag) on two groups: torch keeps each group's p2p traffic apart.

    Rank 1 sends A to rank 2 on WORLD, then B on group [1, 2], same tag; rank 0 sends C
    to rank 2 on WORLD. Rank 2 first receives on the subgroup (src=1, then src=None),
    then on WORLD. In torch every process group has its own channels, so the subgroup
    receives get B and nothing from rank 0 (not even a member).
    """
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                          world_size=ws)
    out: dict[str, Any] = {}
    try:
        for name, lib in (("gloo", td), ("rankwise", rw)):
            sub = lib.new_group([1, 2])
            a, b, c = (torch.full((4,), v) for v in (1.0, 2.0, 3.0))
            works = []  # isend: gloo's send would wait for rank 2 to post the matching recv
            if rank == 1:
                works = [lib.isend(a, dst=2, tag=5), lib.isend(b, dst=2, group=sub, tag=5),
                         lib.isend(b, dst=2, group=sub, tag=6)]
            elif rank == 0:
                works = [lib.isend(c, dst=2, tag=6)]
            lib.barrier()
            if rank == 2:
                got = []
                for src, group, tag in ((1, sub, 5), (None, sub, 6), (1, None, 5),
                                        (None, None, 6)):
                    t = torch.zeros(4)
                    sender = lib.recv(t, src=src, group=group, tag=tag)
                    got.append((int(sender), float(t[0])))
                out[name] = got
            for w in works:
                w.wait()
            lib.barrier()
    finally:
        td.destroy_process_group()
    return out


def torch_213_names(rank: int, ws: int, torch_port: int) -> dict[str, Any]:
    """torch 2.13's ``all_gather_single``/``reduce_scatter_single`` (it deprecates the
    ``_tensor`` names for them) on rankwise and on gloo, same inputs; rank 0 calls the
    old name where the others call the new one, which must still be one call."""
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                          world_size=ws)
    out: dict[str, Any] = {}
    try:
        mine = torch.arange(3, dtype=torch.float32) + 10 * rank
        big = torch.arange(3 * ws, dtype=torch.int64) * (rank + 1)
        for name, lib in (("gloo", td), ("rankwise", rw)):
            gathered = torch.zeros(3 * ws)  # gloo takes the flat form only
            scattered = torch.zeros(3, dtype=torch.int64)
            if lib is rw and rank == 0:
                lib.all_gather_into_tensor(gathered, mine)
                lib.reduce_scatter_tensor(scattered, big)
            else:
                lib.all_gather_single(gathered, mine)
                lib.reduce_scatter_single(scattered, big)
            out[name] = (gathered.tolist(), scattered.tolist())
    finally:
        td.destroy_process_group()
    return out
