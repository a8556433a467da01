"""NaN/Inf origin, opt-in (``RANKWISE_NAN_CHECK=1``, ``rankwise run --nan-check``).

Why: one rank's NaN in a gradient is summed into every rank's weights by the next
all_reduce, and after that nobody can tell where it came from. With the check on, a
reducing collective (all_reduce, reduce, reduce_scatter) first looks at its input for
non-finite values, then the ranks agree on the verdict (one small all_reduce of a flag
per rank, over the same group) before any data moves: so every rank raises the same
``NonFiniteInput`` and no rank's data has changed. The report names the rank(s), the
call, the user's file:line and, for DDP buckets (rankwise's DDP, torch's on backend
"rankwise"), the parameters whose gradients held it and the step (backward pass).

Off, it costs one boolean test per collective (``on``, read by the call path). On, a
pass over the input and one extra small collective per reducing call; the names and
counts are gathered only once a non-finite value was found (docs/stragglers.md).

Shaped as a call-path observer's ``before`` (docs/design.md, "Checks are observers").
"""

from __future__ import annotations

import gc
import sys
import threading
import warnings
from typing import Any

import numpy as np

from .. import settings
from ..errors import DistError

__all__ = ["NonFiniteInput", "before", "on", "set_on"]

#: the switch the call path reads (one boolean test per collective when off)
on = settings.flag("RANKWISE_NAN_CHECK")

_state = threading.local()  #: ``busy``: inside the check's own collectives
#: per call site (its id): [the autograd graph task of its last call, steps seen]
_steps: dict[int, list[int]] = {}
_NAMES_SHOWN = 8


def set_on(value: bool) -> None:
    """Turn the check on or off at run time (every rank must agree)."""
    global on
    on = bool(value)


class NonFiniteInput(DistError):
    """A reducing collective's input held a NaN or Inf on some rank; raised on every rank
    of the group before any data moved. ``reports``: per offending rank, what it found."""

    def __init__(self, message: str, ranks: list[int], reports: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.reports = reports


def before(group: Any, op_name: str, tensors: list[Any] | None, site: Any) -> None:
    """Check a reducing call's inputs, agree on the verdict, raise on every rank if any
    rank's held a non-finite value. Runs on the caller's thread before the call is
    registered (its own collectives take the group's next sequence numbers on every
    rank alike)."""
    if not tensors or getattr(_state, "busy", False):
        return
    bad = _scan(tensors)
    step = _step(site)
    flags = np.zeros(group.size(), np.int32)
    if bad is not None:
        flags[group.group_rank] = 1
    from ..api.collectives import all_reduce
    from ..api.objects import all_gather_object
    from ..wire.buffers import ReduceOp

    _state.busy = True
    try:
        all_reduce(flags, op=ReduceOp.MAX, group=group)
        if not flags.any():
            return
        mine = None if bad is None else {"rank": group.comm.rank, "count": bad[0],
                                         "first": bad[1], "params": _params(), "step": step}
        everyone: list[Any] = [None] * group.size()
        all_gather_object(everyone, mine, group=group)
    finally:
        _state.busy = False
    reports = [r for r in everyone if r]
    raise NonFiniteInput(_message(op_name, tensors, site, group, reports),
                         [r["rank"] for r in reports], reports)


def _scan(tensors: list[Any]) -> tuple[int, int] | None:
    """(non-finite values, index of the first) in the inputs taken as one, or None."""
    offset = 0
    for t in tensors:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(t, torch.Tensor):
            if not (t.is_floating_point() or t.is_complex()):
                offset += t.numel()
                continue
            finite = torch.isfinite(t)
            if not bool(finite.all()):  # on CUDA a host sync (docs/stragglers.md)
                where = (~finite).reshape(-1).nonzero()
                return int(where.numel()), offset + int(where[0])
            offset += t.numel()
        elif isinstance(t, np.ndarray) and t.dtype.kind in "fc":
            finite_np = np.isfinite(t)
            if not finite_np.all():
                where_np = np.flatnonzero(~finite_np)
                return int(where_np.size), offset + int(where_np[0])
            offset += t.size
    return None


def _step(site: Any) -> int:
    """Which step this call is in, per call site: the backward passes (autograd graph
    tasks) that made a reducing call here, counted from the first one; outside a
    backward pass, the calls made here."""
    torch = sys.modules.get("torch")
    task = int(torch._C._current_graph_task_id()) if torch is not None else -1
    seen = _steps.get(site.id)
    if seen is None:
        _steps[site.id] = [task, 1]
        return 1
    if task == -1 or task != seen[0]:
        seen[0] = task
        seen[1] += 1
    return seen[1]


def _params() -> list[str]:
    """The parameters of this process's DDP models whose gradients hold a NaN or Inf
    (failure path only: DDP models are found by the garbage collector's list)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    ddp_type = torch.nn.parallel.DistributedDataParallel  # rankwise's DDP is one too
    names: list[str] = []
    with warnings.catch_warnings():  # isinstance on some listed objects warns (deprecations)
        warnings.simplefilter("ignore")
        models = [obj for obj in gc.get_objects() if isinstance(obj, ddp_type)]
    for obj in models:
        for name, p in obj.module.named_parameters():
            g = p.grad
            if g is not None and not bool(torch.isfinite(g).all()) and name not in names:
                names.append(name)
    return names


def _message(op_name: str, tensors: list[Any], site: Any, group: Any,
             reports: list[dict[str, Any]]) -> str:
    first = tensors[0]
    dtype = str(getattr(first, "dtype", "")).replace("torch.", "")
    size = sum(int(t.numel()) if hasattr(t, "numel") else int(np.size(t)) for t in tensors)
    parts = []
    for r in reports:
        text = (f"rank {r['rank']}'s input holds {r['count']} NaN/Inf value(s) (the first at "
                f"element {r['first']})")
        if r["params"]:
            shown = ", ".join(r["params"][:_NAMES_SHOWN])
            more = len(r["params"]) - _NAMES_SHOWN
            text += f", in the gradient of {shown}" + (f" and {more} more" if more > 0 else "")
        parts.append(text + f", at step {r['step']}")
    ranks = ", ".join(str(r["rank"]) for r in reports)
    return (f"non-finite input to {op_name}({dtype} x {size}) at {site.short} on "
            f"{group.name}: {'; '.join(parts)}. Nothing was reduced: every rank raises this "
            f"before any rank's data changed (RANKWISE_NAN_CHECK); look at rank(s) {ranks}")
