"""``DistributedDataParallel``: one model replica per process, gradients averaged in backward.

Each rank runs forward and backward on its own shard of the batch. During backward the
:class:`~rankwise.nn._reducer.Reducer` all-reduces gradient buckets while later layers
are still being differentiated, so after ``loss.backward()`` every rank holds the same
averaged gradients and any torch optimizer applies the same update everywhere. The
replicas therefore stay identical without ever sending parameters, except once at
construction (rank 0's values) and buffers before each forward.

Differences from torch's DDP, on purpose or not yet done: one device per module (CPU,
or one GPU: buckets live on the module's device); buckets
keep reverse registration order (torch re-orders them once after the first iteration
from the observed gradient order); ``static_graph=True`` means "the set of unused
parameters never changes" and is computed once; ``register_comm_hook`` takes hooks that
return a future (torch's ``allreduce_hook`` included) but not torch's built-in C++ hooks.

Identity with torch's class: it derives from ``torch.nn.parallel.DistributedDataParallel``
so that ``isinstance`` checks ("unwrap if DDP") in scripts and libraries pass, but it never
runs torch's ``__init__`` (which would build torch's C++ reducer on a torch process
group). Every torch method that would reach those missing internals is shadowed by one
that raises ``NotImplementedError`` (``_refuse_torch_internals``); what remains from
torch's class is ``nn.Module`` behaviour, ``train`` and the active-module class hooks.

Pickling (``torch.save(ddp)``, ``copy.deepcopy``) keeps the module and settings and drops
the reducer and process group; the copy evaluates, and refuses to train with an error
that says to wrap its ``.module`` again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from rankwise.errors import InvalidArgument
from rankwise.nn._comm_hook import CommHook, check_hook
from rankwise.nn._errors import DDPError
from rankwise.nn._join import JoinState
from rankwise.nn._reducer import Reducer, ReducerStatistics
from rankwise.nn._sync import agree_on_parameters, broadcast_tensors, signature_of

__all__ = ["DistributedDataParallel"]

_MIB = 1024 * 1024


class DistributedDataParallel(_TorchDDP):
    """Data-parallel wrapper with ``torch.nn.parallel.DistributedDataParallel``'s interface.

    Construction is collective: every rank of ``process_group`` must construct it, with
    the same model. ``forward`` is collective too when ``broadcast_buffers`` is set and
    the module has buffers, so evaluate on one rank through ``ddp.module``, not ``ddp``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # not torch DDP's: see the module docstring
        _check_one_device(module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise InvalidArgument(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        cap_mb = 25.0 if bucket_cap_mb is None else float(bucket_cap_mb)
        if cap_mb <= 0:
            raise InvalidArgument(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self.device_ids = None
        self.output_device = None
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int(cap_mb * _MIB)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._join: JoinState | None = None

        everything = list(module.named_parameters()) + [
            (f"buffer:{n}", b) for n, b in module.named_buffers()
        ]
        self.group_ranks: list[int] = agree_on_parameters(signature_of(everything), process_group)
        self._world = len(self.group_ranks)
        if self._world > 1:
            broadcast_tensors(self.module_states(), self.group_ranks[0], process_group)
        _replace_earlier_wrapper(module)
        # torch's class declares its C++ reducer here; ours is None on an unpickled copy
        self.reducer: Reducer | None = Reducer(  # type: ignore[assignment]
            [p for _, p in named],
            [n for n, _ in named],
            process_group,
            self.bucket_bytes_cap,
            find_unused=find_unused_parameters,
            static_graph=static_graph,
            grad_as_view=gradient_as_bucket_view,
        )
        _REDUCERS[module] = weakref.ref(self.reducer)

    @property  # torch's is read-only over its own attribute; this one is plain state
    def broadcast_buffers(self) -> bool:
        return self._broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._broadcast_buffers = value

    # -- pickling: torch.save(ddp), copy.deepcopy(ddp) --------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the live parts: the reducer (hooks on this process's
        parameters, in-flight work) and the process group do not survive a pickle."""
        state = dict(self.__dict__)
        state.update(reducer=None, process_group=None, _join=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)  # type: ignore[no-untyped-call]

    def _live_reducer(self) -> Reducer:
        """The reducer, or a clear error on a copy that came out of a pickle."""
        if self.reducer is None:
            raise DDPError(
                "this DistributedDataParallel is a copy (torch.load / copy.deepcopy): its "
                "gradient reducer and process group are not saved with it, so it cannot "
                "train. Wrap the loaded model's .module in a new DistributedDataParallel "
                "(on every rank) to train it; to evaluate, call .eval() or use torch.no_grad()."
            )
        return self.reducer

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)`` (torch's contract).

        ``bucket`` is a :class:`rankwise.GradBucket` holding the bucket's gradients
        *undivided*; the hook returns a future (``Work.get_future()``, possibly chained
        with ``then``) whose value is the reduced flat tensor, averaging included.
        Call it on every rank, before the first backward, once.
        """
        check_hook(hook)
        self._live_reducer().register_comm_hook(CommHook(hook, state))

    # -- what gets synchronised ----------------------------------------------------------

    def module_buffers(self) -> list[torch.Tensor]:
        """The wrapped module's buffers, in registration order."""
        return [b.detach() for b in self.module.buffers()]

    def module_states(self) -> list[torch.Tensor]:
        """Parameters then buffers: what must be equal on every rank."""
        return [p.detach() for p in self.module.parameters()] + self.module_buffers()

    def syncs_buffers(self) -> bool:
        """Whether each forward broadcasts the buffers from the first training rank."""
        return (
            self.broadcast_buffers
            and self.require_forward_param_sync
            and self._world > 1
            and any(True for _ in self.module.buffers())
        )

    # -- training --------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.reducer is None and not (self.training and torch.is_grad_enabled()):
            return self.module(*inputs, **kwargs)  # an unpickled copy, evaluating alone
        reducer = self._live_reducer()
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        source = self.group_ranks[0]
        if self._join is not None:
            source = self._join.before_forward(will_sync)
        if will_sync:
            reducer.prepare_for_backward()
        else:
            reducer.disarm()
        if self.syncs_buffers():
            broadcast_tensors(self.module_buffers(), source, self.process_group)
        outputs = self.module(*inputs, **kwargs)
        if will_sync:
            reducer.find_unused(outputs)
        return outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block syncs them all.

        Forward *and* backward of the accumulation steps must run inside the block.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Train on uneven inputs across ranks (see :mod:`rankwise.nn._join`).

        ``with ddp.join(): for batch in loader: ...`` — ranks whose loader ends early
        take part in the others' remaining collectives with zero gradients; everybody
        leaves the block with the same parameters.
        """
        if not enable:
            yield
            return
        if self._join is not None:
            raise InvalidArgument("ddp.join() contexts cannot be nested")
        state = JoinState(
            self,
            divide_by_initial_world_size=divide_by_initial_world_size,
            throw_on_early_termination=throw_on_early_termination,
        )
        self._join = state
        try:
            yield
            self._join = None
            state.shadow_until_all_joined()
        finally:
            self._join = None

    def statistics(self) -> ReducerStatistics:
        """Bucket layout and how long backward waited for communication."""
        return self._live_reducer().statistics()


def _check_one_device(module: nn.Module) -> None:
    """The module lives on the CPU or on one CUDA device; say so before any collective.

    Buckets are made on the module's device, so a CUDA module's gradients are reduced
    by the group's NCCL engine (or staged through host memory on a CPU backend).
    ``device_ids``/``output_device`` are not looked at: scripts pass
    ``device_ids=[local_rank]`` out of habit, and the module's own device decides.
    """
    devices = {str(t.device) for t in module.parameters()}
    devices |= {str(t.device) for t in module.buffers()}
    kinds = {d.split(":", 1)[0] for d in devices}
    if kinds - {"cpu", "cuda"} or len(devices) > 1:
        raise InvalidArgument(
            f"rankwise DistributedDataParallel needs the module on the CPU or on one CUDA "
            f"device, got {sorted(devices)}; move it with module.to(device) first."
        )


_TORCH_SAFE = frozenset({"train", "_get_active_ddp_module", "_active_ddp_module"})
"""torch DDP members that only touch nn.Module state (or a class attribute), kept."""


def _refuse_torch_internals() -> None:
    """Shadow every torch DDP method this class does not define with one that raises.

    They would read torch's C++ reducer, logger and process group, which this class
    never creates, and fail obscurely (or half-work) somewhere inside torch.
    """
    ours = DistributedDataParallel.__dict__
    for name, member in vars(_TorchDDP).items():
        if name.startswith("__") or name in ours or name in _TORCH_SAFE:
            continue
        if isinstance(member, property):
            setattr(DistributedDataParallel, name, property(_refusal(name)))
        elif callable(member) or isinstance(member, (classmethod, staticmethod)):
            setattr(DistributedDataParallel, name, _refusal(name))


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"DistributedDataParallel.{name} belongs to torch's own DDP internals, which "
            "rankwise.nn.DistributedDataParallel does not run (it only shares torch's "
            "class for isinstance checks). Use torch's DDP on backend 'rankwise' "
            "(import rankwise.torch) if you need it."
        )

    refuse.__name__ = name
    return refuse


_refuse_torch_internals()


#: each wrapped module's latest reducer (not an attribute: a module must stay picklable)
_REDUCERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Reducer]] = \
    weakref.WeakKeyDictionary()


def _replace_earlier_wrapper(module: nn.Module) -> None:
    """A module wrapped again (after ``rankwise.shrink``/``grow``, on the new world) is
    reduced by its new wrapper only: the earlier one's gradient hooks come off, or they
    would go on firing into a reducer of the old world (possibly stopped mid-backward by
    the failure: "marked as ready twice")."""
    earlier = _REDUCERS.get(module)
    reducer = earlier() if earlier is not None else None
    if reducer is not None:
        reducer.remove_hooks()
