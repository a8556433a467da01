"""The one way every collective takes from the API to an engine and back.

Why one: a call's checks and records (sequence number, fingerprint, call site, history,
who-is-where, the profiler's event, the failure seam) must be the same whichever entry
made it (rankwise's API, torch's backend "rankwise", DDP's buckets, a kept tensor view or
a fresh one) and whichever engine moves the data, so they are written here once:

    launch: describe (fingerprint, call site) -> route (host or device engine)
            -> group.begin (seq, history) -> the group's observers on that engine
            -> [queued async calls first]
            -> run (inline, inline async on the caller's stream, or on the async worker):
               before -> engine op -> enqueued -> order/wait -> after | failed
               (``api.observers``; the failure seam, ``explain``, turns an engine's
               fact into rankwise's exception before ``failed`` sees it)

What an engine can do besides a blocking call is read from its declared ``Engine.caps``
(``engines.base.Caps``), never found by ``getattr``. docs/design.md, "One call path".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..checks import nan_check
from ..core.failures import explain
from ..core.work import Work, run_async
from ..engines.base import Call, Engine, EngineFact, Observers
from ..engines.device.pair import device_engine
from ..identity.calls import Fingerprint
from ..identity.callsite import capture
from ..wire.buffers import DType, ReduceOp
from ..wire.frames import Op
from . import profiling
from .observers import observed

if TYPE_CHECKING:
    from ..core.group import ProcessGroup
    from .plans import Plan

__all__ = ["Body", "launch"]

#: a collective's body: given the group's engine and the call, run the data movement
Body = Callable[[Engine, Call], None]
#: ``Op.name`` is an enum property (~0.3 us); this runs once per call
_OP_NAMES = {op: op.name for op in Op}


def launch(group: ProcessGroup, op: Op, dtype: DType | None, count: int,
           reduce_op: ReduceOp | None, root: int, body: Body, async_op: bool,
           engine: Engine | None = None, shape: tuple[int, ...] | None = None,
           outputs: list[Any] | None = None, flags: int = 0,
           inputs: list[Any] | None = None, plan: Plan | None = None,
           depth: int = 3, split: bool = False) -> Work | None:
    """Register the call (sequence number, fingerprint, call site), then run ``body`` on
    the group's engine (``engine`` overrides it: per-peer calls use ``group.messages``),
    inline or, with ``async_op``, on the async worker. ``shape``: the user's tensor's,
    for messages only (the fingerprint compares element counts, as before).
    ``outputs``: the user's output tensors, the value of the ``Work``'s future.
    ``flags``: call flags (``wire.frames.CALL_FLAGS``) that set this call apart from a plain one
    of the same op (``Flag.SYNC``: a rank-0-first block's barrier).
    ``inputs``: the user's input tensors where they are not ``outputs``, for the
    profiler event's shapes (``api.profiling``; none is made without a profiler).
    ``plan``: a kept view's (``api.plans``): its fingerprint is made once, not per call.
    ``depth``: the frames from the call site to here (the public function and this).
    ``split``: ``body`` ends with the engine's op (nothing reads its result after it), so
    an async call may run on the caller's thread where the engine completes its ops on
    threads of its own (``Caps.run_split``: torch's gloo)."""
    ev = profiling.Event(_OP_NAMES[op], outputs if inputs is None else inputs) \
        if profiling.recording() and profiling.on() else None
    site = capture(depth)
    if nan_check.on and reduce_op is not None:  # opt-in, before anything is registered
        nan_check.before(group, _OP_NAMES[op], outputs if inputs is None else inputs, site)
    if engine is None:  # tensors that stay tensors (CUDA) go to the device engine
        if dtype is None or not dtype.tensor:
            engine = group.engine
        else:
            route = group.device_route
            if route is None or route[0] is not group.engine:
                route = group.device_route = (group.engine, *device_engine(group))
            engine = route[1]
            flags |= route[2]
    if plan is None:
        fp = Fingerprint(int(op), dtype.code if dtype else 0,
                         reduce_op.code if reduce_op else 0, flags, root, count)
    else:
        fp = plan.fp  # type: ignore[assignment]
        if fp is None or fp.flags != flags:
            fp = plan.fp = Fingerprint(int(op), dtype.code if dtype else 0,
                                       reduce_op.code if reduce_op else 0, flags, root, count)
    runner = engine
    call = group.begin(fp, site, dtype, reduce_op, runner.framed, shape)
    obs = group.observers.get(runner) if ev is None else None
    if obs is None:
        obs = observed(group, runner, ev is not None)
        call.event = ev
    call.observers = obs
    if async_op:
        caps = runner.caps
        inline = caps.run_inline
        if inline is None and split:  # gloo: its threads run the op, no worker of ours
            inline = caps.run_split
        if inline is not None:  # a device engine: the caller's stream carries the order
            return _run_inline(group, runner, call, body, outputs, inline)
        job: Callable[[], None] = lambda: _run(runner, call, body)
        device = None
        adopt = caps.adopt_async  # device engines: the caller's stream
        if adopt is not None:
            job, device = adopt(job)
        work = run_async(f"{call.label or op.name} #{call.seq} on {group.name}", job,
                         outputs, device, owner=group.comm)
        if runner.serial:
            group.queued = work
        return work
    if runner.serial and group.queued is not None:
        _queued_first(group, call)
    _run(runner, call, body)
    return None


def _queued_first(group: ProcessGroup, call: Call) -> None:
    """The queued async calls run first, in order, on every rank (``Engine.serial``);
    their own errors are theirs to report (``Work.wait``), this call's engine raises too."""
    queued = group.queued
    assert queued is not None
    queued.done_within(max(0.0, call.deadline - time.monotonic()))
    group.queued = None


def _run_inline(group: ProcessGroup, runner: Engine, call: Call, body: Body,
                outputs: list[Any] | None, inline: Callable[..., Any]) -> Work:
    """An ``async_op`` call on a device engine, run here on the caller's thread (no hop to
    the async worker: the works it enqueues follow the caller's stream, as torch's do).
    Its error is the ``Work``'s, raised by ``wait``; earlier queued calls run first."""
    if runner.serial and group.queued is not None:
        _queued_first(group, call)
    device, error = inline(call, _run, runner, call, body)
    return Work.ended(call.title, outputs, device, error)


def _run(engine: Engine, call: Call, body: Body) -> None:
    """Run one call's body on ``engine`` inside its observers (``call.observers``):
    ``before`` (here, or by an engine that reports its phases once its local checks
    passed), ``enqueued`` (reported by such an engine), ``after`` or ``failed``."""
    obs: Observers = call.observers
    try:
        if obs.by_path:
            obs.before(call)
        body(engine, call)
        obs.after(call)
    except EngineFact as fact:  # the failure seam: one wording for every engine
        exc = explain(call.group.comm, call, fact)
        obs.failed(call, exc)
        raise exc from None
    except BaseException as exc:
        obs.failed(call, exc)
        raise
