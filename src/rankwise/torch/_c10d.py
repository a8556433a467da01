# torch's stubs give Backend's methods other signatures than the options forms torch's C++
# calls; the bodies are TorchProcessGroup's (see below).
# mypy: disable-error-code="override,misc"
"""rankwise as a c10d ``Backend`` under torch's own ``ProcessGroup``, where torch lets
Python subclass ``Backend`` (a trampoline: 2.14 and 2.15, see ``backend_trampoline``).

Why (docs/design.md, "The seam torch sees"): torch's flight recorder, health check,
``split_group``, ``set_timeout``, ``monitored_barrier`` and ``device_id=`` ask a group's
registered backends (``pg._device_types``, ``pg._get_backend(device)``, the group name
c10d keeps on them); a Python ``ProcessGroup`` subclass has none, so torch skips or
refuses it. Under torch's own ``ProcessGroup`` rankwise is one of its backends, and
torch's C++ (DDP's reducer too) reaches these methods through the trampoline.

The collectives are ``TorchProcessGroup``'s own functions, copied onto this class
(``_SHARED``): one body each, whichever base a torch gets. The differences are what a
``Backend`` owes torch's C++ that a ``ProcessGroup`` subclass does not:
- a ``Work`` from every call (torch's C++ ``ProcessGroup`` keeps and hooks it), where the
  subclass returns ``None`` for a synchronous call;
- every property torch's C++ asks (``supports_*``, ``options``): left to the trampoline,
  each recursed into itself (``RecursionError``);
- ``split`` (``split_group``, and ``new_group`` once the default group is bound to a
  device), ``set_timeout``, ``monitored_barrier``, ``eager_connect_single_device``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as tdist
from torch._C._distributed_c10d import Backend as C10DBackend
from torch._C._distributed_c10d import OpType as C10DOpType  # type: ignore[attr-defined]

from ..core.group import ProcessGroup as RankwiseGroup
from ..errors import DistError, InvalidArgument
from ..rewrap import dropped, frameless
from ._backend import BACKEND_NAME, TorchProcessGroup
from ._work import ChainedAsyncWork, DoneWork

__all__ = ["TorchBackend", "backend_trampoline", "completion_from_future"]


#: the op type of a ``Work`` made by none of torch's backends
_UNKNOWN_OP = int(C10DOpType.UNKNOWN)


@functools.cache
def completion_from_future() -> None:
    """``Work.is_completed()`` true once the work's future is done, on the c10d route.

    Why: torch hands a Python backend's ``Work`` to Python in a C++ holder
    (``PyWorkHolder``, 2.15) that forwards ``wait`` and ``get_future`` only; its
    ``is_completed`` is c10d's base answer, a flag nothing of Python's can set, so it
    stayed False after ``wait()`` (gloo's is True), and a loop polling it never ended.
    Answered here where C++ says False of such a holder (its op type is c10d's
    ``UNKNOWN``: no backend of torch's made it) by the work's future, which the holder
    forwards (ours completes when the call has run). Not of torch's own works: NCCL's
    future is done once the kernel is queued, before the work is. One wrapper, installed
    once; a holder without a future keeps C++'s answer."""
    asked = tdist.Work.is_completed

    def is_completed(work: tdist.Work) -> bool:
        done = asked(work)
        if done or work._get_op_type() != _UNKNOWN_OP:  # type: ignore[attr-defined]
            return bool(done)
        try:
            return bool(work.get_future().done())
        except RuntimeError:  # c10d's base getFuture: "not implemented"
            return False

    is_completed.__doc__ = asked.__doc__
    tdist.Work.is_completed = is_completed  # type: ignore[method-assign,assignment]


@functools.cache
def backend_trampoline() -> bool:
    """Whether this torch lets a Python class derive from c10d's ``Backend`` (2.13 and
    before: "No constructor defined")."""
    class _Probe(C10DBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return False
    return True


def _with_work(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` returning a ``Work`` always: a finished one over its first argument (the
    tensors) where the shared body returned ``None`` (a synchronous call, done)."""
    @functools.wraps(method)
    def call(self: TorchBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            work = method(self, *args, **kwargs)
        except DistError as error:  # leaves with no frame of rankwise's (rewrap)
            if dropped(error):
                raise
            raise error  # noqa: TRY201 - Python 3.10: with this frame only
        return DoneWork(args[0] if args else None) if work is None else work
    return call


#: TorchProcessGroup's methods that are this backend's (each returns a Work here)
_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
    "allgather_coalesced", "all_gather_single", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall_base", "alltoall",
    "gather", "scatter", "barrier", "send", "recv", "recv_anysource")
#: and the ones it takes as they are
_SHARED = ("_allreduce", "_bounded", "shutdown", "rankwise_group", "__repr__")


class TorchBackend(C10DBackend):
    """torch's backend of one rankwise group, registered under torch's ``ProcessGroup``
    for the cpu (and cuda) devices."""

    group: RankwiseGroup
    _async_work = ChainedAsyncWork  # its future torch's C++ hands out in a wrapper of its own

    def __init__(self, group: RankwiseGroup, owns_world: bool, options: Any = None) -> None:
        super().__init__(group.group_rank, group.size())
        completion_from_future()
        TorchProcessGroup._attach(self, group, owns_world)  # type: ignore[arg-type]
        self._options = options if isinstance(options, C10DBackend.Options) else C10DBackend.Options(
            BACKEND_NAME, timeout=timedelta(seconds=group.timeout))

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def options(self) -> Any:
        return self._options

    # --- what torch's C++ asks a backend (each answered, none left to recurse) -----------
    supports_splitting = property(lambda self: True)
    supports_coalescing = property(lambda self: False)
    supports_shrinking = property(lambda self: False)
    supports_reconfigure = property(lambda self: False)
    supports_window = property(lambda self: False)
    supports_abort_hooks = property(lambda self: False)
    supports_completion_hooks = property(lambda self: False)
    _supports_time_estimate = property(lambda self: False)

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    # --- the seams --------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        """``dist.set_timeout``: the group's timeout from the next call on."""
        self.group.timeout = timeout.total_seconds()
        self._options._timeout = timeout

    _set_default_timeout = set_timeout

    def eager_connect_single_device(self, device: Any) -> None:
        """``init_process_group(device_id=)``: rankwise's mesh is already connected."""

    def perform_nocolor_split(self, device: Any) -> None:
        """A non-member's part of torch's split of the default group: rankwise makes a
        group among its members only, so there is nothing to do."""

    def split(self, store: Any, ranks: list[int], opts: Any = None) -> TorchBackend | None:
        """``split_group``/``new_group`` through the parent: the members of ``ranks``
        (this group's ranks) become a rankwise group, named as torch names it."""
        from ..api import init as _init
        from ..api.world import current
        from ._cuda_backend import attach_cuda
        from ._register import _group_id

        ranks = [int(r) for r in ranks]
        if ranks != sorted(ranks):
            raise InvalidArgument(f"split_group on backend \"rankwise\": each group's ranks "
                                  f"must be in increasing order, got {ranks}")
        if self.group.group_rank not in ranks:
            return None
        members = [self.group.ranks[r] for r in ranks]
        name = str(getattr(opts, "group_name", "") or "") or f"split {members}"
        timeout = getattr(opts, "_timeout", None) or timedelta(seconds=self.group.timeout)
        group = _init.make_group(current(), _group_id(name), members,
                                 timeout.total_seconds(), f"torch group {name} {members}")
        attach_cuda(current(), group)
        return TorchBackend(group, owns_world=False, options=opts)

    @frameless
    def monitored_barrier(self, opts: Any, wait_all_ranks: bool = False) -> None:
        """torch's ``monitored_barrier``: rankwise's, which names the ranks that did not
        arrive, with a who-is-where table."""
        from ..diagnosis.sync import monitored_barrier

        timeout = getattr(opts, "timeout", None)
        monitored_barrier(self.group, timeout, wait_all_ranks)


for _name in _COLLECTIVES:
    setattr(TorchBackend, _name, _with_work(getattr(TorchProcessGroup, _name)))
for _name in _SHARED:
    setattr(TorchBackend, _name, TorchProcessGroup.__dict__[_name])
del _name
