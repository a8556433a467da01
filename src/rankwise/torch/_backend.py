# torch's stubs give these methods overloaded convenience forms (``gather(outs, in, root)``)
# that torch's Python never calls on a backend; the options form below is the one it calls.
# mypy: disable-error-code="override,assignment"
"""A ``torch.distributed.ProcessGroup`` whose every operation runs on a rankwise group.

Why a ``ProcessGroup`` subclass and not a ``Backend``: torch 2.13 gives Python a
trampoline for ``ProcessGroup`` (its C++ callers, DDP's reducer and
``_broadcast_coalesced`` included, reach the Python methods below) but none for
``Backend``; 2.14+ does, and there the same methods serve a c10d ``Backend``
(``_c10d.TorchBackend``, docs/design.md "The seam torch sees"). torch's own wrapper
functions (``all_reduce``, ``all_gather_object``, ...) validate and unpack, then call
these methods with lists of tensors and an options object.

Each method calls rankwise's public collective on the wrapped group, so the call gets
rankwise's local checks, fingerprint, call site (torch's frames skipped, see
``identity.callsite.skip_directory``) and failure reports. ``allreduce``, the call of every
``torch.distributed.all_reduce`` and every DDP bucket, takes the way rankwise's own
``all_reduce`` of a tensor takes (``api.plans.all_reduce_tensor``: one view cache and one
plan per kept tensor for both) and the reduce op is read once, by its hash, so what the backend adds to rankwise's own call is about
torch's Python wrapper and no more (``benchmarks/torch_backend.py``).

Collectives run inline and return a completed ``Work`` (``_work.DoneWork``: its future,
made when asked for, holds the result), or ``None`` when torch's Python wrapper said the
call is synchronous (``opts.asyncOp`` false): every wrapper then skips ``work.wait()``
("the backend has synced"). The exception is an asynchronous dense ``all_reduce``
(DDP's reducer, whose C++ leaves ``asyncOp`` at its default, true, and
``async_op=True``): it runs on rankwise's async worker and returns an ``AsyncWork``
whose torch future completes there, so DDP's buckets are reduced while backward goes
on, as on gloo. A ``recv`` returns a ``Work`` whose ``wait`` finishes the receive.

What torch hands a backend, the backend takes as gloo does:
- a tensor that requires grad, a leaf included, is communicated through its detached
  alias (same memory). rankwise's own API refuses to write into such a leaf, which
  protects a user who would silently bypass autograd; here torch's own callers hand
  them on purpose (``torch.distributed.pipelining`` receives into buffers that require
  grad, then starts backward from them), and gloo writes them.
- ``opts.timeout`` (``barrier(timeout=)``, and any op's options) bounds that call instead
  of the group's timeout (see :meth:`TorchProcessGroup._bounded`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from ..api import collectives as coll
from ..api import p2p, profiling
from ..api.plans import all_reduce_tensor
from ..api.world import maybe_current, resolve_group
from ..core.group import ProcessGroup as RankwiseGroup
from ..errors import DistError, InvalidArgument
from ..rewrap import dropped
from ..wire.buffers import ReduceOp, coerce_reduce_op
from ..wire.reduce_op import make_premul_sum, torch_premul_factor
from ._sparse import check_sparse, sparse_all_reduce
from ._work import AsyncWork, DoneWork, RecvWork

__all__ = ["BACKEND_NAME", "TorchProcessGroup"]

BACKEND_NAME = "rankwise"
_STRIDED = torch.strided  #: a dense tensor's layout (sparse COO ones take ``_sparse``)
Tensors = list[torch.Tensor]
#: torch's ``kUnsetTimeout``: an option's timeout nobody set (the group's applies)
_UNSET_TIMEOUT = timedelta(milliseconds=-1)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _bare(x: Any) -> Any:
    """``x`` (a tensor, or nested lists of them) with every tensor that requires grad
    replaced by its detached alias: the same memory, which gloo writes too (module
    docstring)."""
    if isinstance(x, list):
        return [_bare(v) for v in x]
    return x.detach() if x.requires_grad else x


def _call_timeout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """The seconds of a set ``opts.timeout`` among a backend method's arguments (torch
    passes the options last), else None."""
    opts = kwargs["opts"] if "opts" in kwargs else (args[-1] if args else None)
    timeout = getattr(opts, "timeout", None)
    if not isinstance(timeout, timedelta) or timeout == _UNSET_TIMEOUT \
            or timeout < timedelta(0):
        return None
    return timeout.total_seconds()


def _honours_timeout(method: _Method) -> _Method:
    """Run ``method`` bounded by its options' timeout where one was set. As every method
    torch calls, it lets a rankwise error out with no frame of rankwise's on it
    (``rewrap.dropped``): torch's C++ passes it on as it is, to the user."""
    @functools.wraps(method)
    def bounded(self: TorchProcessGroup, *args: Any, **kwargs: Any) -> Any:
        try:
            seconds = _call_timeout(args, kwargs)
            if seconds is None:
                return method(self, *args, **kwargs)
            with self._bounded(seconds):
                return method(self, *args, **kwargs)
        except DistError as error:
            if dropped(error):
                raise
            raise error  # noqa: TRY201 - Python 3.10: with this frame only
    return bounded  # type: ignore[return-value]


def _finish(opts: Any, result: Any) -> tdist.Work | None:
    """The return value of a collective that already ran (see the module docstring)."""
    if opts is not None and not opts.asyncOp:
        return None
    return DoneWork(result)


_REDUCE_OPS: dict[int, ReduceOp] = {}


def _hash_is_the_op() -> bool:
    """Whether torch's ``ReduceOp`` hashes to its ``RedOpType`` value (torch 2.x does), so
    that ``hash(opts.reduceOp)`` alone names the operator: one pybind call (~0.3 us)
    where ``.op`` and hashing the enum it returns take two (~0.8 us)."""
    try:
        kinds: Any = tdist.ReduceOp.RedOpType
        premul: Any = getattr(tdist, "_make_nccl_premul_sum")  # noqa: B009 - not in stubs
        plain = [k for k in kinds.__members__.values() if k != kinds.PREMUL_SUM]
        return all(hash(tdist.ReduceOp(k)) == int(k) for k in plain) and \
            hash(premul(2.0)) == int(kinds.PREMUL_SUM)
    except (AttributeError, RuntimeError, TypeError):  # another torch: take the long way
        return False


_HASH_IS_THE_OP = _hash_is_the_op()
_PREMUL_SUM = int(tdist.ReduceOp.RedOpType.PREMUL_SUM)  # type: ignore[attr-defined]


def _reduce_op(opts: Any) -> ReduceOp:
    """The rankwise operator of torch's ``opts.reduceOp`` (a pybind property: a new
    object per access, ~0.5 us, so it is read once). Cached by the operator's number,
    except PREMUL_SUM (``torch.distributed._make_nccl_premul_sum(f)``), whose factor may
    change from call to call."""
    if opts is None:
        return ReduceOp.SUM
    red = opts.reduceOp
    key = hash(red) if _HASH_IS_THE_OP else int(red.op)
    found = _REDUCE_OPS.get(key)
    if found is None:
        kind = red.op
        if int(kind) == _PREMUL_SUM:
            return make_premul_sum(torch_premul_factor(red))
        found = _REDUCE_OPS[key] = coerce_reduce_op(kind)
    return found


def _one(tensors: Any, what: str) -> Any:
    if len(tensors) != 1:
        raise InvalidArgument(f"{what}: the rankwise backend takes one tensor per call "
                              f"(one device per process), got {len(tensors)}")
    return tensors[0]


class TorchProcessGroup(tdist.ProcessGroup):
    """torch's view of one rankwise group (made by the backend's creator function)."""

    #: the ``Work`` of an async call (``_c10d.TorchBackend`` chains its future: C++ re-wraps it)
    _async_work: type[AsyncWork] = AsyncWork

    def __init__(self, group: RankwiseGroup, owns_world: bool) -> None:
        # the (rank, size) constructor: the one a Python subclass gets (no store needed)
        super().__init__(group.group_rank, group.size())  # type: ignore[call-arg]
        self._attach(group, owns_world)

    def _attach(self, group: RankwiseGroup, owns_world: bool) -> None:
        """What the methods below read; ``_c10d.TorchBackend``, which shares them, too."""
        self.group = group
        self._owns_world = owns_world

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # --- the group's name -----------------------------------------------------------------
    # c10d keeps a group's name on its registered ``Backend`` objects (``setGroupName``
    # writes to each, ``getGroupName`` reads the first); a Python ``ProcessGroup`` has
    # none, so torch's ``pg._set_group_name(name)`` (``_new_process_group_helper``) was
    # lost and ``pg.group_name`` raised "ProcessGroup name not set", breaking
    # ``destroy_process_group(pg)`` and every Python reader of the name. Kept here.
    _rankwise_group_name: str | None = None

    def _set_group_name(self, name: str) -> None:
        self._rankwise_group_name = str(name)

    @property
    def group_name(self) -> str:
        if self._rankwise_group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._rankwise_group_name

    @property
    def rankwise_group(self) -> RankwiseGroup:
        """The rankwise group under this torch group (for rankwise's own API)."""
        return self.group

    def __repr__(self) -> str:
        return f"<rankwise torch backend over {self.group!r}>"

    def _get_backend(self, device: Any) -> Any:
        """This group itself where torch has no C++ ``Backend`` for ``device`` (a Python
        ``ProcessGroup`` registers none). torch 2.14 asks every group for one in
        ``batch_isend_irecv`` (``getattr(group._get_backend(device),
        "supports_coalescing", False)``, written for Python backends that answer with
        their ``ProcessGroup``); before, it raised "No backend type associated"."""
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    @contextmanager
    def _bounded(self, seconds: float) -> Iterator[None]:
        """The group's timeout is ``seconds`` for the calls made inside: rankwise reads it
        when a call begins (its deadline) and when it words the timeout, so the call is
        bounded, and reported, by torch's per-call ``opts.timeout``. One thread calls a
        torch group at a time (torch's own groups assume it too)."""
        group = self.group
        saved, group.timeout = group.timeout, seconds
        try:
            yield
        finally:
            group.timeout = saved

    # --- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors: Tensors, opts: Any = None) -> tdist.Work | None:
        try:
            if opts is None or len(tensors) != 1 or tensors[0].layout is not _STRIDED \
                    or tensors[0].requires_grad or opts.timeout != _UNSET_TIMEOUT:
                return self._allreduce(tensors, opts)
            # every torch.distributed.all_reduce, every DDP bucket: the call rankwise's own
            # ``all_reduce`` of a tensor makes (one view cache, one plan per kept tensor)
            g = resolve_group(self.group)
            assert g is not None  # torch makes a group only on its members
            if not opts.asyncOp:  # torch's synchronous wrapper: run inline, no Work
                all_reduce_tensor(g, tensors[0], _reduce_op(opts), False, tensors, tensors)
                return None
            # DDP's reducer and async_op=True: run on rankwise's async worker, so backward
            # goes on while the bucket is reduced (torch's callbacks run on that worker)
            work = all_reduce_tensor(g, tensors[0], _reduce_op(opts), True, tensors, tensors)
            assert work is not None
            return self._async_work(work, tensors)
        except DistError as error:  # leaves with no frame of rankwise's (rewrap)
            if dropped(error):
                raise
            raise error  # noqa: TRY201 - Python 3.10: with this frame only

    @_honours_timeout
    def _allreduce(self, tensors: Tensors, opts: Any = None) -> tdist.Work | None:
        """The all_reduces the hot path leaves: several or sparse tensors, a tensor that
        requires grad, a per-call timeout."""
        rop = _reduce_op(opts)
        for t in tensors:  # every sparse tensor checked before any I/O
            if t.layout is not _STRIDED:
                check_sparse(t, rop)
        with profiling.event("all_reduce", tensors):  # one event, as on gloo
            for t in _bare(tensors):
                if t.layout is _STRIDED:
                    coll.all_reduce(t, rop, group=self.group)
                else:
                    sparse_all_reduce(t, rop, self.group)
        return _finish(opts, tensors)

    allreduce_coalesced = allreduce  # one tensor per call either way (``_one``)

    @_honours_timeout
    def broadcast(self, tensors: Tensors, opts: Any) -> tdist.Work | None:
        with profiling.event("broadcast", tensors):
            for t in _bare(tensors):
                coll.broadcast(t, group=self.group, group_src=opts.rootRank)
        return _finish(opts, tensors)

    @_honours_timeout
    def reduce(self, tensors: Tensors, opts: Any) -> tdist.Work | None:
        coll.reduce(_bare(_one(tensors, "reduce")), op=_reduce_op(opts), group=self.group,
                    group_dst=opts.rootRank)
        return _finish(opts, tensors)

    @_honours_timeout
    def allgather(self, output_tensors: list[Tensors], input_tensors: Tensors,
                  opts: Any = None) -> tdist.Work | None:
        coll.all_gather(_bare(_one(output_tensors, "all_gather")),
                        _bare(_one(input_tensors, "all_gather")), group=self.group)
        return _finish(opts, output_tensors)

    @_honours_timeout
    def allgather_coalesced(self, output_lists: list[Tensors], inputs: Tensors,
                            opts: Any = None) -> tdist.Work | None:
        # torch's layout is ``output_lists[rank][i]`` (rank r's copy of input i), the
        # transpose of what one all_gather per input wants: gather input i into column i
        size = self.group.size()
        if len(output_lists) != size or any(len(row) != len(inputs) for row in output_lists):
            raise InvalidArgument(
                f"all_gather_coalesced: output_tensor_lists must be {size} lists (one per "
                f"rank) of {len(inputs)} tensors (one per input), got "
                f"{[len(row) for row in output_lists]}")
        rows = _bare(output_lists)
        with profiling.event("all_gather", inputs):  # gloo's name for it too
            for i, inp in enumerate(_bare(inputs)):
                coll.all_gather([row[i] for row in rows], inp, group=self.group)
        return _finish(opts, output_lists)

    @_honours_timeout
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> tdist.Work | None:
        coll.all_gather_into_tensor(_bare(output), _bare(input), group=self.group)
        return _finish(opts, [output])

    _allgather_base = all_gather_single  #: the name torch's C++ side uses

    @_honours_timeout
    def allgather_into_tensor_coalesced(self, outputs: Tensors, inputs: Tensors,
                                        opts: Any = None) -> tdist.Work | None:
        with profiling.event("all_gather_into_tensor", inputs):
            for out, inp in zip(_bare(outputs), _bare(inputs), strict=True):
                coll.all_gather_into_tensor(out, inp, group=self.group)
        return _finish(opts, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_honours_timeout
    def reduce_scatter(self, output_tensors: Tensors, input_tensors: list[Tensors],
                       opts: Any) -> tdist.Work | None:
        coll.reduce_scatter(_bare(_one(output_tensors, "reduce_scatter")),
                            _bare(_one(input_tensors, "reduce_scatter")), _reduce_op(opts),
                            group=self.group)
        return _finish(opts, output_tensors)

    @_honours_timeout
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any) -> tdist.Work | None:
        coll.reduce_scatter_tensor(_bare(output), _bare(input), _reduce_op(opts),
                                   group=self.group)
        return _finish(opts, [output])

    _reduce_scatter_base = reduce_scatter_single

    @_honours_timeout
    def reduce_scatter_tensor_coalesced(self, outputs: Tensors, inputs: Tensors,
                                        opts: Any) -> tdist.Work | None:
        with profiling.event("reduce_scatter_tensor", inputs):
            for out, inp in zip(_bare(outputs), _bare(inputs), strict=True):
                coll.reduce_scatter_tensor(out, inp, _reduce_op(opts), group=self.group)
        return _finish(opts, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_honours_timeout
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> tdist.Work | None:
        coll.all_to_all_single(_bare(output), _bare(input), list(output_split_sizes) or None,
                               list(input_split_sizes) or None, group=self.group)
        return _finish(opts, [output])

    alltoall_base = all_to_all_single

    @_honours_timeout
    def alltoall(self, output_tensors: Tensors, input_tensors: Tensors,
                 opts: Any = None) -> tdist.Work | None:
        coll.all_to_all(_bare(output_tensors), _bare(input_tensors), group=self.group)
        return _finish(opts, output_tensors)

    @_honours_timeout
    def gather(self, output_tensors: list[Tensors], input_tensors: Tensors,
               opts: Any) -> tdist.Work | None:
        root = opts.rootRank
        slots = _one(output_tensors, "gather") if self.group.group_rank == root else None
        coll.gather(_bare(_one(input_tensors, "gather")), _bare(slots) if slots else slots,
                    group=self.group, group_dst=root)
        return _finish(opts, output_tensors)

    @_honours_timeout
    def scatter(self, output_tensors: Tensors, input_tensors: list[Tensors],
                opts: Any) -> tdist.Work | None:
        root = opts.rootRank
        parts = _one(input_tensors, "scatter") if self.group.group_rank == root else None
        coll.scatter(_bare(_one(output_tensors, "scatter")), _bare(parts) if parts else parts,
                     group=self.group, group_src=root)
        return _finish(opts, output_tensors)

    @_honours_timeout
    def barrier(self, opts: Any = None) -> tdist.Work | None:
        coll.barrier(group=self.group)
        return _finish(opts, None)

    # --- point to point -------------------------------------------------------------------
    @_honours_timeout  # no options, no timeout: for its frames (rewrap)
    def send(self, tensors: Tensors, dst: int, tag: int) -> tdist.Work:
        p2p.send(_bare(_one(tensors, "send")), group=self.group, tag=tag, group_dst=dst)
        return DoneWork(tensors)  # torch's send waits on it unconditionally

    @_honours_timeout
    def recv(self, tensors: Tensors, src: int, tag: int) -> tdist.Work:
        work = p2p.irecv(_bare(_one(tensors, "recv")), group=self.group, tag=tag,
                         group_src=src)
        assert work is not None
        return RecvWork(work, tensors)

    @_honours_timeout
    def recv_anysource(self, tensors: Tensors, tag: int) -> tdist.Work:
        work = p2p.irecv(_bare(_one(tensors, "recv")), group=self.group, tag=tag)
        assert work is not None
        return RecvWork(work, tensors)

    # --- leaving --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: the default group takes rankwise's world
        with it (peers learn where this rank left); a subgroup only forgets itself."""
        from ..api.init import destroy_process_group

        if maybe_current() is None or self.group.retired is not None:
            return  # no world, or the group's was replaced (shrink/grow) and is closed
        destroy_process_group(None if self._owns_world else self.group)
