"""Make ``torch.distributed.init_process_group("rankwise")`` work, under any launcher.

Rendezvous, decided (and why):
- rankwise keeps its own rendezvous (world-size agreement, duplicate and missing ranks,
  ranks that died before the group formed, the authenticated mesh), run on whatever store
  torch hands the backend, so torchrun, ``init_method="tcp://..."`` or ``file://`` need
  nothing extra: no second port to choose.
- Under ``rankwise run`` the launcher hosts rankwise's store on ``MASTER_PORT``, which
  torch's own ``env://`` rendezvous cannot speak to. So the ``env://`` handler is wrapped:
  in a job started by ``rankwise run`` it gives torch a view of the launcher's store
  (:class:`TorchStoreView`); anywhere else it is torch's handler, untouched. The backend
  then finds the launcher store under torch's prefixes and rankwise runs on it directly.
  Side effect, wanted: backend ``"gloo"`` works under ``rankwise run`` too.
"""

from __future__ import annotations

import importlib
import os
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from .. import settings
from ..api import init as _init
from ..api.recovery import follow_rebuilds
from ..api.world import current, maybe_current
from ..core.group import ProcessGroup as RankwiseGroup
from ..errors import InvalidArgument
from ..identity.callsite import skip_directory
from ..store.torch_views import RankwiseStoreView, TorchStoreView, rankwise_store_under
from ..wire.auth import resolve_token
from ._backend import BACKEND_NAME, TorchProcessGroup
from ._c10d import TorchBackend, backend_trampoline
from ._cuda_backend import DEVICES, attach_cuda
from ._follow import follow_world

__all__ = ["c10d_route", "install"]

_views: list[TorchStoreView] = []  #: the store views handed to torch, kept alive
#: the engine of the next default group when ``takeover`` made it of a plain torch request
#: (``"cpu:torch-gloo"``, with ``",cuda:nccl"`` when NCCL was asked for); None: rankwise's own
engine_backend: str | None = None
_taken_over: Any = None  #: the world made with ``engine_backend`` (its CUDA plane is chosen)


def _launched_by_rankwise() -> bool:
    return settings.flag("RANKWISE_LAUNCHED") and settings.flag("RANKWISE_AGENT_STORE")


def _wrap_env_handler(torch_handler: Callable[..., Iterator[Any]]
                      ) -> Callable[..., Iterator[Any]]:
    def handler(url: str, timeout: timedelta = timedelta(minutes=30),
                **kwargs: Any) -> Iterator[Any]:
        if not _launched_by_rankwise():
            yield from torch_handler(url, timeout=timeout, **kwargs)
            return
        spec = _init._resolve_store(url, -1, -1)  # ?rank=&world_size= override the env
        rank, world_size = spec.rank, spec.world_size
        store = _init._open_store(spec, timeout.total_seconds(), resolve_token(None))
        view = TorchStoreView(store)
        # torch keeps only the C++ half; without a Python reference the overrides vanish
        # ("pure virtual function c10d::Store::add") and the view cannot be found again
        _views.append(view)
        yield view, rank, world_size
        raise RuntimeError("env:// under rankwise run cannot re-rendezvous; the launcher "
                           "restarts the whole group instead (--max-restarts)")

    handler.rankwise_wraps = torch_handler  # type: ignore[attr-defined]
    return handler


def _group_id(name: str) -> int:
    """A group id every member derives alike from torch's group name (torch asks only the
    members, so rankwise's per-call counter would differ between ranks). Bit 31 keeps it
    apart from the ids ``rankwise.new_group`` makes."""
    return (zlib.crc32(f"torch:{name}".encode()) | 0x8000_0000) & 0xFFFF_FFFF


def _attach_cuda(group: Any) -> None:
    """The CUDA plane of backend "rankwise" (``attach_cuda``); a world ``takeover`` made
    already names what its CUDA tensors use (``engine_backend``)."""
    if current() is not _taken_over:
        attach_cuda(current(), group)


#: ``RANKWISE_TORCH_ROUTE=subclass`` keeps the ``ProcessGroup`` subclass on a torch with
#: the ``Backend`` trampoline (to compare the two; docs/design.md, "The seam torch sees")
ROUTE_ENV = "RANKWISE_TORCH_ROUTE"


def c10d_route() -> bool:
    """Whether backend "rankwise" is a c10d ``Backend`` under torch's own ``ProcessGroup``
    (this torch has the trampoline, and ``ROUTE_ENV`` does not ask for the subclass)."""
    return backend_trampoline() and settings.choice(ROUTE_ENV) != "subclass"


def _torch_group(group: RankwiseGroup, owns_world: bool,
                 options: Any) -> TorchProcessGroup | TorchBackend:
    """A c10d ``Backend`` under torch's own ``ProcessGroup`` where ``c10d_route``, else the
    ``ProcessGroup`` subclass."""
    if c10d_route():
        return TorchBackend(group, owns_world, options)
    return TorchProcessGroup(group, owns_world)


def _create(opts: Any, backend_options: Any) -> TorchProcessGroup | TorchBackend:
    """torch's backend creator (extended API): the default group joins (or reuses) the
    rankwise world; any other group becomes a rankwise group of the same global ranks."""
    global _taken_over
    rank, size, timeout = int(opts.group_rank), int(opts.group_size), opts.timeout
    if not tdist.is_initialized():  # torch is making its default group
        world = maybe_current()
        if world is None:
            store = rankwise_store_under(opts.store) or RankwiseStoreView(opts.store, timeout)
            _init.init_process_group(engine_backend or "tcp", rank=rank, world_size=size,
                                     timeout=timeout, store=store)
            _taken_over = current() if engine_backend else None
            _attach_cuda(current().default_group)
            return _torch_group(current().default_group, True, backend_options)
        if (world.comm.rank, world.comm.world_size) != (rank, size):
            raise InvalidArgument(
                f"rankwise is already initialized as rank {world.comm.rank} of "
                f"{world.comm.world_size}, but torch asks for rank {rank} of {size}")
        return _torch_group(world.default_group, False, backend_options)
    members = sorted(int(r) for r in opts.global_ranks_in_group)
    group = _init.make_group(current(), _group_id(str(opts.group_id)), members,
                             timeout.total_seconds(), f"torch group {opts.group_id} {members}")
    _attach_cuda(group)
    return _torch_group(group, False, backend_options)


def install() -> None:
    """Register the backend (for the cpu and cuda devices), wrap ``env://``, skip torch's frames in
    call sites. Idempotent: importing ``rankwise.torch`` twice changes nothing."""
    if BACKEND_NAME.upper() not in tdist.Backend._plugins:
        tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                       devices=DEVICES)
    # the module, not the function ``torch.distributed.rendezvous`` that shadows its name
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if not hasattr(handlers["env"], "rankwise_wraps"):
        handlers["env"] = _wrap_env_handler(handlers["env"])
    skip_directory(os.path.dirname(torch.__file__))
    follow_rebuilds(follow_world)  # torch's default group moves to the world shrink made
