"""The tensor collectives of torch.distributed, validated locally before any I/O.

Each function: resolve the group (a non-member rank returns at once, as in torch),
turn tensors into flat buffers (rejecting wrong types, non-contiguous memory, wrong
list lengths and sizes with ``InvalidArgument``), build the call's fingerprint, then
run it on the group's engine — inline, or on the async worker with ``async_op``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checks import nan_check
from ..core.communicator import Activity, Communicator
from ..core.failures import explain
from ..core.group import ProcessGroup
from ..core.work import Work, new_ended, run_async
from ..engines.base import Call, Engine, EngineFact, new_call
from ..engines.device.pair import device_engine
from ..errors import InvalidArgument
from ..identity.calls import COMM_LABEL, Fingerprint, barrier_name_code
from ..identity.callsite import capture
from ..wire.buffers import (
    Buffer,
    DType,
    ReduceOp,
    as_buffer,
    check_reducible,
    coerce_reduce_op,
    premultiply,
)
from ..wire.device import concat, flat_copy, same_memory
from ..wire.frames import Op
from . import profiling
from . import world as world_module
from .world import resolve_group

__all__ = [
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "gather", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
]

#: a collective's body: given the group's engine and the call, run the data movement
Body = Callable[[Engine, Call], None]
#: ``Op.name`` is an enum property (~0.3 us); this runs once per call
_OP_NAMES = {op: op.name for op in Op}
_activity = Activity.of_call


def launch(group: ProcessGroup, op: Op, dtype: DType | None, count: int,
           reduce_op: ReduceOp | None, root: int, body: Body, async_op: bool,
           engine: Engine | None = None, shape: tuple[int, ...] | None = None,
           outputs: list[Any] | None = None, flags: int = 0,
           inputs: list[Any] | None = None, plan: Plan | None = None) -> Work | None:
    """Register the call (sequence number, fingerprint, call site), then run ``body`` on
    the group's engine (``engine`` overrides it: per-peer calls use ``group.messages``),
    inline or, with ``async_op``, on the async worker. ``shape``: the user's tensor's,
    for messages only (the fingerprint compares element counts, as before).
    ``outputs``: the user's output tensors, the value of the ``Work``'s future.
    ``flags``: call flags (``wire.frames.CALL_FLAGS``) that set this call apart from a plain one
    of the same op (``Flag.SYNC``: a rank-0-first block's barrier).
    ``inputs``: the user's input tensors where they are not ``outputs``, for the
    profiler event's shapes (``api.profiling``; none is made without a profiler).
    ``plan``: a kept view's (``memo_plan``): its fingerprint is made once, not per call."""
    ev = profiling.Event(_OP_NAMES[op], outputs if inputs is None else inputs) \
        if profiling.on() else None
    site = capture(3)  # skips launch and the public function: both rankwise's own
    if nan_check.on and reduce_op is not None:  # opt-in (the pipeline's observer, later)
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
                         reduce_op.code if reduce_op else 0, root, count, flags)
    else:
        fp = plan.fp  # type: ignore[assignment]
        if fp is None or fp.flags != flags:
            fp = plan.fp = Fingerprint(int(op), dtype.code if dtype else 0,
                                       reduce_op.code if reduce_op else 0, root, count, flags)
        route = group.device_route
        bound = plan.bound
        if route is not None and (bound is None or route is not bound[0]) \
                and route[1] is engine and flags == route[2] and reduce_op is plan.rop:
            plan.bind(route, fp, group)  # once per route: the torch backend's calls come each time
    runner = engine
    call = group.begin(fp, site, dtype, reduce_op, runner.framed, shape)
    if async_op or ev is not None:
        inline = getattr(runner, "run_inline", None) if async_op else None
        if inline is not None:  # a device engine: the caller's stream carries the order
            return _run_inline(group, runner, call, body, op, ev, outputs, inline)
        # under a profiler a synchronous call too runs on the async worker while the
        # caller waits, as gloo's calls run on gloo's thread: its event ends there,
        # asynchronous for real (``api.profiling``)
        job: Callable[[], None] = lambda: _run(runner, call, body, op, ev)
        device = None
        adopt = getattr(runner, "adopt_async", None)  # device engines: the caller's stream
        if adopt is not None:
            job, device = adopt(job)
        work = run_async(f"{call.label or op.name} #{call.seq} on {group.name}", job,
                         outputs, device, owner=group.comm)
        if runner.serial:
            group.queued = work
        if not async_op:
            work.wait()
            return None
        return work
    if runner.serial and group.queued is not None:
        # the queued async calls run first, in order, on every rank (``Engine.serial``);
        # their own errors are theirs to report (Work.wait), this call's engine raises too
        group.queued.done_within(max(0.0, call.deadline - time.monotonic()))
        group.queued = None
    _run(runner, call, body, op, ev)
    return None


def _device_all_reduce(group: ProcessGroup, plan: Plan, bound: Bound, tensor: Any,
                       async_op: bool) -> Work | None:
    """``launch`` of a kept view's all_reduce on the group's device engine, for the case
    ``all_reduce`` checked: the plan's route is the group's (its engine, fingerprint and
    flags hold), no async call is queued, no profiler records, and an async call runs
    inline. The same steps as ``launch``'s, with the lookups and branches that the plan
    already answered left out, and the engine's own hot path where it has one
    (``TorchEngine.hot_all_reduce``: an async call's ``Work`` holds its one record).
    docs/gpu.md. ``bound``: the plan's ``Plan.bound``, read once by the caller."""
    route, fp, inline, hot, _ = bound
    runner = route[1]
    call = group.begin(fp, capture(3), plan.dtype, plan.rop, runner.framed, plan.shape)
    if hot is None:
        if async_op:
            device, error = inline(call, _run, runner, call,  # type: ignore[misc]
                                   plan.body, Op.all_reduce, None)
            return Work.ended(call.title, [tensor], device, error)
        _run(runner, call, plan.body, Op.all_reduce)
        return None
    comm = group.comm  # ``_run`` and ``run_inline``, written out
    comm.doing = call  # the call stands for its own ``Activity``: made only if asked
    try:
        p = hot(call, not async_op)
    except BaseException as exc:  # noqa: BLE001 - raised, or an async call's ``Work``'s
        return _hot_failed(comm, call, exc, tensor, async_op)
    comm.call_done(call)
    return Work.ended(call.title, [tensor], p, None) if async_op else None


def _hot_failed(comm: Communicator, call: Call, exc: BaseException, tensor: Any,
                async_op: bool) -> Work:
    """The hot path's call ``call`` raised ``exc``: its public error (an engine's fact
    explained), raised, or an async call's ``Work`` that holds it; the call ends here
    either way. Shared by ``_device_all_reduce`` and its steps in C (``_hotcall``)."""
    try:
        failure = explain(comm, call, exc) if isinstance(exc, EngineFact) else exc
    finally:
        comm.call_done(call)
    if async_op:
        return Work.ended(call.title, [tensor], None, failure)
    if failure is exc:
        raise exc
    failure.__context__ = exc  # as ``raise ... from None`` in its except clause sets it
    raise failure from None


def _run_inline(group: ProcessGroup, runner: Engine, call: Call, body: Body, op: Op,
                ev: profiling.Event | None, outputs: list[Any] | None,
                inline: Callable[..., Any]) -> Work:
    """An ``async_op`` call on a device engine, run here on the caller's thread (no hop to
    the async worker: the works it enqueues follow the caller's stream, as torch's do).
    Its error is the ``Work``'s, raised by ``wait``; earlier queued calls run first."""
    if runner.serial and group.queued is not None:
        group.queued.done_within(max(0.0, call.deadline - time.monotonic()))
        group.queued = None
    device, error = inline(call, _run, runner, call, body, op, ev)
    return Work.ended(call.title, outputs, device, error)


def _run(engine: Engine, call: Call, body: Body, op: Op,
         ev: profiling.Event | None = None) -> None:
    """Run one call's body on ``engine``, with who-is-where state around it."""
    group = call.group
    comm = group.comm
    comm.doing = _activity(_OP_NAMES[op], group.id, call.seq, call.site, call.started)
    try:
        body(engine, call)
    except EngineFact as fact:  # the failure seam: one wording for every engine
        raise explain(comm, call, fact) from None
    finally:
        comm.call_done(call)  # history, trace span, back to "user code"
        if ev is not None:
            ev.end()


def _same_dtype(bufs: list[Buffer], ref: Buffer, what: str) -> None:
    for i, b in enumerate(bufs):
        if b.dtype != ref.dtype:
            if b.dtype.tensor != ref.dtype.tensor:
                raise InvalidArgument(f"{what}[{i}] is on {_device(b)} but the input is on "
                                      f"{_device(ref)}; all tensors of one call share a device")
            raise InvalidArgument(f"{what}[{i}] has dtype {b.dtype.name} but the input has "
                                  f"{ref.dtype.name}; all tensors of one call share a dtype")


def _device(b: Buffer) -> str:
    where = getattr(b.original, "device", None)
    return "the host (numpy)" if where is None else str(where)


def _list(xs: Any, n: int, what: str, writable: bool) -> list[Buffer]:
    if not isinstance(xs, (list, tuple)):
        raise InvalidArgument(f"{what} must be a list of tensors, got {type(xs).__name__}")
    if len(xs) != n:
        raise InvalidArgument(f"{what} has {len(xs)} tensors but the group has {n} ranks; "
                              "it needs exactly one per rank")
    return [as_buffer(x, f"{what}[{i}]", writable) for i, x in enumerate(xs)]


def _equal_sizes(bufs: list[Buffer], numel: int, what: str) -> None:
    for i, b in enumerate(bufs):
        if b.numel != numel:
            raise InvalidArgument(f"{what}[{i}] has {b.numel} elements, expected {numel}")


#: (dtype code, reduce-op code) pairs already found reducible: the check's answer
#: depends on nothing else, and a training loop asks the same question every step
_REDUCIBLE: set[tuple[int, int]] = set()


def _reduce_op(op: Any, buf: Buffer, what: str) -> ReduceOp:
    rop = coerce_reduce_op(op)
    key = (buf.dtype.code, rop.code)
    if key not in _REDUCIBLE:
        check_reducible(buf.dtype, rop, what)
        _REDUCIBLE.add(key)
    return rop


# --- collectives --------------------------------------------------------------------------

def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src")
    return launch(g, Op.broadcast, buf.dtype, buf.numel, None, root,
                  lambda engine, call: engine.broadcast(call, buf.array, root), async_op,
                  shape=buf.shape, outputs=[tensor])


def _root(g: ProcessGroup, global_rank: int | None, group_rank: int | None, name: str,
          default: int | None = None) -> int:
    """The group-local index of a root given as a global rank (torch's ``src``/``dst``)
    or as a group rank (``group_src``/``group_dst``); ``default`` when neither is given."""
    if global_rank is None and group_rank is None and default is not None:
        global_rank = default
    if global_rank is not None and group_rank is not None:
        raise InvalidArgument(f"pass {name} or group_{name}, not both")
    if group_rank is not None:
        if not isinstance(group_rank, int) or not 0 <= group_rank < g.size():
            raise InvalidArgument(f"group_{name}={group_rank!r} is not in 0..{g.size() - 1}")
        return group_rank
    if global_rank is None:
        raise InvalidArgument(f"{name} (the root rank) is required")
    return g.group_rank_of(global_rank, name)


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    if _front is not None:  # a kept view's call on the default group, checks and steps in C
        done = _front(tensor, op, group, async_op)
        if done is not NotImplemented:
            return done  # type: ignore[no-any-return]
    g = resolve_group(group)
    if g is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        # a training loop's tensors come again and again: their view and body are kept
        # (``tensor_view``, ``coerce_reduce_op`` and ``memo_plan`` with their common
        # case written out: ~0.6 us of a small device call)
        buf, memo = (_views if _views is not None else _made_views()).view(tensor, "tensor")
        rop = op if op.__class__ is ReduceOp and op.factor is None else coerce_reduce_op(op)
        # a bare PREMUL_SUM finds no plan (none with a factor is kept): ``memo_plan`` raises
        plan: Plan | None = memo.get(rop.code)
        if plan is None or rop.factor is not None:
            plan = memo_plan(buf, memo, rop)
        bound = plan.bound
        if bound is not None and bound[0] is g.device_route and bound[0][0] is g.engine \
                and g.queued is None and (not async_op or bound[2] or bound[3]) \
                and not (profiling.recording() and profiling.on()):
            fast = bound[4]
            if fast is not None:  # the steps in C; NotImplemented: begin's own path
                done = fast(capture(2), async_op, tensor)
                if done is not NotImplemented:
                    return done  # type: ignore[no-any-return]
            return _device_all_reduce(g, plan, bound, tensor, async_op)
        return launch(g, Op.all_reduce, buf.dtype, plan.count, rop, 0, plan.body, async_op,
                      shape=buf.shape, outputs=[tensor], plan=plan)
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "all_reduce")
    return launch(g, Op.all_reduce, buf.dtype, buf.numel, rop, 0, all_reduce_body(buf, rop),
                  async_op, shape=buf.shape, outputs=[tensor])


#: the API's views of the small torch tensors it has seen (``api.views``, which imports
#: torch: made when the first torch tensor comes)
_views: Any = None


def tensor_view(tensor: Any) -> tuple[Buffer, dict[Any, Any]]:
    """``as_buffer(tensor, "tensor", writable=True)`` of a torch tensor, remembered while
    the tensor stays as it was (``api.views``), and its memo."""
    buf, memo = (_views if _views is not None else _made_views()).view(tensor, "tensor")
    return buf, memo


def _made_views() -> Any:
    global _views, _front
    if _views is None:
        from .views import TensorViews
        _views = TensorViews()
        if _CFront is not None:  # ``all_reduce``'s checks below, for its views, in C
            _front = _CFront(_views.entries, sys.modules["torch"].Tensor, ReduceOp, Plan,
                             vars(world_module), world_module._thread_worlds,
                             vars(profiling), capture)
    return _views


#: ``all_reduce``'s checks and steps for a kept view's call in C (``_hotcall.Front``),
#: made with the views; NotImplemented from it: the checks below run
_front: Any = None


class Plan:
    """A kept view's all_reduce for one reduce op (``memo_plan``): its checked body, its
    element count (a flat tensor's ``shape[0]`` is a torch call, ~0.25 us) and its
    fingerprint once ``launch`` made it: the same on every call of the view."""

    __slots__ = ("array", "body", "bound", "count", "dtype", "fp", "rop", "shape")

    def __init__(self, body: Body, buf: Buffer, rop: ReduceOp) -> None:
        self.body = body
        self.array = buf.array
        self.count = buf.numel
        self.dtype = buf.dtype
        self.shape = buf.shape
        self.rop = rop
        self.fp: Fingerprint | None = None
        #: ``_device_all_reduce``'s per-call lookups, made once per route by ``launch``
        #: (``bind``); None until then
        self.bound: Bound | None = None

    def bind(self, route: tuple[Engine, Engine, int], fp: Fingerprint,
             group: ProcessGroup) -> None:
        """Keep, in one tuple (a thread sees all of one route's or none): ``route`` (the
        group's ``device_route``), ``fp`` (made with its flags), the route's device
        engine's ``run_inline`` (None: async calls go to the async worker) and its hot
        path for this view and op (``TorchEngine.hot_all_reduce``; None: none)."""
        engine = route[1]
        make_hot = getattr(engine, "hot_all_reduce", None)
        hot = make_hot(self.array, self.rop.name) if make_hot is not None else None
        self.bound = (route, fp, getattr(engine, "run_inline", None), hot,
                      self._in_c(group, fp, engine, hot))

    def _in_c(self, group: ProcessGroup, fp: Fingerprint, engine: Engine,
              hot: Callable[[Call, bool], Any] | None) -> Callable[..., Any] | None:
        """``_device_all_reduce``'s steps with ``begin`` and ``call_done`` in C
        (``rankwise._hotcall``), where the engine's hot path is in C too; else None."""
        if _CAllReduce is None or not hot_in_c or not isinstance(hot, _CEnqueue):
            return None
        comm = group.comm
        router = comm.router
        return _CAllReduce(group, comm, router, comm.calls, comm.calls.idle,
                           group.history.append, fp, self.dtype, self.rop, self.shape,
                           COMM_LABEL, new_call, hot, _hot_failed, new_ended,
                           router.register_call if engine.framed else None, group.id, Call)


#: a plan bound to a route (``Plan.bind``): (route, fingerprint, ``run_inline``, the
#: engine's hot path ``hot(call, then)``, the whole call in C ``fast(site, async_op,
#: tensor)`` or None)
Bound = tuple[tuple[Engine, Engine, int], Fingerprint, "Callable[..., Any] | None",
              "Callable[[Call, bool], Any] | None", "Callable[..., Any] | None"]

try:  # ``_device_all_reduce``'s steps in C, built by ``pip install`` where it found a compiler
    from .._hotcall import AllReduce as _CAllReduce
    from .._hotcall import Enqueue as _CEnqueue
    from .._hotcall import Front as _CFront
except ImportError:
    _CAllReduce = None  # type: ignore[assignment,misc]
    _CEnqueue = None  # type: ignore[assignment,misc]
    _CFront = None  # type: ignore[assignment,misc]
#: tests turn the C steps off to run the Python ones (both give the same records)
hot_in_c = True


def memo_plan(buf: Buffer, memo: dict[Any, Any], rop: ReduceOp) -> Plan:
    """The all_reduce plan of a kept view (``memo``) for ``rop``, checked and made on its
    first use; PREMUL_SUM's factor may change between calls, so its plan is made anew.
    Keyed by the op's code: hashing a ``ReduceOp`` runs its Python ``__hash__``."""
    if rop.factor is not None:  # kept nowhere: a bare PREMUL_SUM must find no plan
        return Plan(all_reduce_body(buf, _reduce_op(rop, buf, "all_reduce")), buf, rop)
    plan: Plan | None = memo.get(rop.code)
    if plan is None:
        plan = memo[rop.code] = Plan(all_reduce_body(buf, _reduce_op(rop, buf, "all_reduce")),
                                     buf, rop)
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


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    buf = as_buffer(tensor, "tensor", writable=True)
    rop = _reduce_op(op, buf, "reduce")
    root = _root(g, dst, group_dst, "dst")

    def body(engine: Engine, call: Call) -> None:
        premultiply(buf.array, buf.dtype, rop)  # torch leaves non-root tensors undefined
        engine.reduce(call, buf.array, root)

    return launch(g, Op.reduce, buf.dtype, buf.numel, rop, root, body, async_op,
                  shape=buf.shape, outputs=[tensor])


def all_gather(tensor_list: Any, tensor: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(tensor, "tensor")
    outs = _list(tensor_list, g.size(), "tensor_list", writable=True)
    _same_dtype(outs, mine, "tensor_list")
    _equal_sizes(outs, mine.numel, "tensor_list")
    slots = [b.array for b in outs]

    def body(engine: Engine, call: Call) -> None:
        if not same_memory(slots[call.rank], mine.array):
            slots[call.rank][...] = mine.array
        engine.all_gather(call, slots)

    return launch(g, Op.all_gather, mine.dtype, mine.numel, None, 0, body, async_op,
                  shape=mine.shape, outputs=[list(tensor_list)], inputs=[tensor])


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(input_tensor, "input_tensor")
    out = as_buffer(output_tensor, "output_tensor", writable=True)
    _same_dtype([out], mine, "output_tensor")
    n = g.size()
    if out.numel != n * mine.numel:
        raise InvalidArgument(f"output_tensor has {out.numel} elements; it needs world size "
                              f"({n}) x input size ({mine.numel}) = {n * mine.numel}")
    slots = [out.array[i * mine.numel:(i + 1) * mine.numel] for i in range(n)]

    def body(engine: Engine, call: Call) -> None:
        if not same_memory(slots[call.rank], mine.array):
            slots[call.rank][...] = mine.array
        engine.all_gather(call, slots)

    return launch(g, Op.all_gather_into_tensor, mine.dtype, mine.numel, None, 0, body, async_op,
                  shape=mine.shape, outputs=[output_tensor], inputs=[input_tensor])


#: torch 2.13's name for it (it deprecates ``all_gather_into_tensor`` in its favour); the
#: same call, so ranks that mix the two names still match
all_gather_single = all_gather_into_tensor


def _root_slots(g: ProcessGroup, root: int, xs: Any, ref: Buffer, op: str, name: str,
                role: str, writable: bool) -> list[np.ndarray[Any, Any]] | None:
    """The root's per-rank tensor list for gather/scatter, validated; None elsewhere.

    As in torch, the list is required on the root and must be None (or empty) on the
    other ranks."""
    if g.group_rank != root:
        if xs:
            raise InvalidArgument(f"{op}: {name} must be None on ranks other than {role} "
                                  f"(rank {g.ranks[root]}), as in torch.distributed")
        return None
    if xs is None:
        raise InvalidArgument(f"{op}: {name} is required on the {role} rank")
    bufs = _list(xs, g.size(), name, writable=writable)
    _same_dtype(bufs, ref, name)
    _equal_sizes(bufs, ref.numel, name)
    return [b.array for b in bufs]


def gather(tensor: Any, gather_list: Any = None, dst: int | None = None, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    mine = as_buffer(tensor, "tensor")
    root = _root(g, dst, group_dst, "dst", default=0)
    slots = _root_slots(g, root, gather_list, mine, "gather", "gather_list", "dst", True)
    return launch(g, Op.gather, mine.dtype, mine.numel, None, root,
                  lambda engine, call: engine.gather(call, mine.array, slots, root), async_op,
                  shape=mine.shape, inputs=[tensor])


def scatter(tensor: Any, scatter_list: Any = None, src: int | None = None, group: Any = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(tensor, "tensor", writable=True)
    root = _root(g, src, group_src, "src", default=0)
    slots = _root_slots(g, root, scatter_list, out, "scatter", "scatter_list", "src", False)
    return launch(g, Op.scatter, out.dtype, out.numel, None, root,
                  lambda engine, call: engine.scatter(call, out.array, slots, root), async_op,
                  shape=out.shape, inputs=[tensor])


def reduce_scatter(output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    ins = _list(input_list, g.size(), "input_list", writable=False)
    _same_dtype(ins, out, "input_list")
    _equal_sizes(ins, out.numel, "input_list")
    rop = _reduce_op(op, out, "reduce_scatter")
    work = concat([b.array for b in ins]) if ins else flat_copy(out.array)
    return _reduce_scatter(g, Op.reduce_scatter, out, work, rop, async_op, input_list)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    inp = as_buffer(input, "input")
    _same_dtype([inp], out, "input")
    if inp.numel != g.size() * out.numel:
        raise InvalidArgument(f"input has {inp.numel} elements; it needs world size "
                              f"({g.size()}) x output size ({out.numel})")
    rop = _reduce_op(op, out, "reduce_scatter_tensor")
    return _reduce_scatter(g, Op.reduce_scatter_tensor, out, flat_copy(inp.array), rop,
                           async_op, [input])


#: torch 2.13's name for it (it deprecates ``reduce_scatter_tensor`` in its favour)
reduce_scatter_single = reduce_scatter_tensor


def _reduce_scatter(g: ProcessGroup, op: Op, out: Buffer, work: np.ndarray[Any, Any],
                    rop: ReduceOp, async_op: bool, inputs: Any) -> Work | None:
    n, m = g.size(), out.numel
    chunks = [work[i * m:(i + 1) * m] for i in range(n)]

    def body(engine: Engine, call: Call) -> None:
        premultiply(work, out.dtype, rop)  # a private copy of the input
        engine.reduce_scatter(call, chunks)
        out.array[...] = chunks[call.rank]

    return launch(g, op, out.dtype, out.numel, rop, 0, body, async_op, shape=out.shape,
                  outputs=[out.original], inputs=list(inputs))


def all_to_all(output_tensor_list: Any, input_tensor_list: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    outs = _list(output_tensor_list, g.size(), "output_tensor_list", writable=True)
    ins = _list(input_tensor_list, g.size(), "input_tensor_list", writable=False)
    _same_dtype(outs, ins[0], "output_tensor_list")
    _same_dtype(ins, ins[0], "input_tensor_list")
    me = g.group_rank
    if outs[me].numel != ins[me].numel:
        raise InvalidArgument(f"output_tensor_list[{me}] has {outs[me].numel} elements but "
                              f"input_tensor_list[{me}] (what this rank sends itself) has "
                              f"{ins[me].numel}")
    return launch(g, Op.all_to_all, ins[0].dtype, -1, None, 0,
                  lambda engine, call: engine.all_to_all(call, [b.array for b in outs],
                                                         [b.array for b in ins]), async_op,
                  inputs=list(input_tensor_list))


def _splits(buf: Buffer, sizes: Any, n: int, what: str) -> list[np.ndarray[Any, Any]]:
    rows = buf.shape[0] if buf.shape else 1
    per_row = buf.numel // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise InvalidArgument(f"{what}: dim 0 ({rows}) is not divisible by the group size "
                                  f"({n}); pass split sizes")
        sizes = [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or any(not isinstance(s, int) or s < 0 for s in sizes):
        raise InvalidArgument(f"{what} split sizes {sizes} must be {n} non-negative ints")
    if sum(sizes) != rows:
        raise InvalidArgument(f"{what} split sizes {sizes} sum to {sum(sizes)}, but dim 0 "
                              f"has {rows} rows")
    out, start = [], 0
    for s in sizes:
        out.append(buf.array[start * per_row:(start + s) * per_row])
        start += s
    return out


def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None,
                      async_op: bool = False) -> Work | None:
    g = resolve_group(group)
    if g is None:
        return None
    out = as_buffer(output, "output", writable=True)
    inp = as_buffer(input, "input")
    _same_dtype([out], inp, "output")
    outs = _splits(out, output_split_sizes, g.size(), "output")
    ins = _splits(inp, input_split_sizes, g.size(), "input")
    me = g.group_rank
    if len(outs[me]) != len(ins[me]):
        raise InvalidArgument(f"output split {me} has {len(outs[me])} elements but input "
                              f"split {me} has {len(ins[me])}")
    return launch(g, Op.all_to_all_single, inp.dtype, -1, None, 0,
                  lambda engine, call: engine.all_to_all(call, outs, ins), async_op,
                  inputs=[input])


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            name: str | None = None) -> Work | None:
    """torch's barrier; ``name`` (rankwise) must then match on every rank: barriers from
    different code pair silently otherwise (the seed-000 trap), a named one cannot."""
    g = resolve_group(group)
    if g is None:
        return None
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"barrier name must be a str, got {name!r}")
    code = barrier_name_code(name) if name else 0  # the name's hash rides in the fingerprint
    return launch(g, Op.barrier, None, code, None, 0,
                  lambda engine, call: engine.barrier(call), async_op, inputs=[])
