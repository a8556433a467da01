"""rankwise: torch.distributed's API, built so that no failure is ever a silent hang.

``import rankwise as dist`` and a torch.distributed script runs unchanged (backend
"gloo" is an alias of rankwise's own CPU engine, "tcp"). Every message carries the
fingerprint of the call that sent it, every wait is bounded, and every failure reaches
every rank as an exception naming the rank, the operation and the user's file:line.
"""

from __future__ import annotations

from typing import Any as _Any

from . import settings as _settings
from ._version import __version__ as __version__
from .api.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from .api.compat import (
    default_pg_timeout,
    get_backend_config,
    get_default_backend_for_device,
    get_node_local_rank,
    get_pg_count,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    record_comm,
    reduce_op,
    supports_complex,
)
from .api.grad_bucket import GradBucket
from .api.init import (
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
)
from .api.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .api.recovery import Membership, grow, membership, shrink
from .api.subgroups import new_subgroups, new_subgroups_by_enumeration
from .api.unsupported import unsupported_error as _unsupported_error
from .api.world import GroupMember
from .checks.stragglers import stragglers
from .core.group import ProcessGroup
from .core.work import Work
from .diagnosis import main_process_first, monitored_barrier, rank_zero_first, who_is_where
from .errors import (
    AuthError,
    CollectiveMismatch,
    DeadlockError,
    DistError,
    DistNetworkError,
    DistTimeout,
    InvalidArgument,
    PeerFailure,
    PeerTimeout,
    RecoveryError,
    RendezvousError,
    StoreError,
)
from .rewrap import unwrap
from .wire.reduce_op import ReduceOp
from .wire.reduce_op import make_premul_sum as _make_nccl_premul_sum  # noqa: F401 - torch's spelling

group = GroupMember  # torch spells the default-group handle dist.group.WORLD
# torch's names for two branches of the tree: `except dist.DistStoreError` keeps working
DistStoreError = StoreError
DistBackendError = DistError


class Backend:
    """Backend names, as ``torch.distributed.Backend``."""

    TCP = "tcp"
    GLOO = "gloo"


def get_process_group_ranks(group: _Any) -> list[int]:
    from .api.world import resolve_group

    g = resolve_group(group)
    if g is None:
        raise InvalidArgument("this rank is not a member of that group")
    return list(g.ranks)


def get_global_rank(group: _Any, group_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise InvalidArgument(f"group_rank {group_rank} is not in 0..{len(ranks) - 1}")
    return ranks[group_rank]


def get_group_rank(group: _Any, global_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if global_rank not in ranks:
        raise InvalidArgument(f"global rank {global_rank} is not in the group {ranks}")
    return ranks.index(global_rank)


def __getattr__(name: str) -> _Any:
    # heavier or optional pieces load on first use, so `import rankwise` stays light
    if name == "spawn":
        from .launch.spawn import spawn

        return spawn
    if name in ("TCPStore", "FileStore", "PrefixStore", "HashStore", "Store"):
        from . import store

        return getattr(store, name)
    if name == "utils":  # rankwise.utils.data needs torch: imported only when asked for
        import importlib

        return importlib.import_module(".utils", __name__)
    error = _unsupported_error(name)
    if error is not None:
        raise error
    raise AttributeError(f"module 'rankwise' has no attribute {name!r}")


if _settings.flag("RANKWISE_LAUNCHED"):
    try:
        from .launch.worker import install_worker_hooks as _install_worker_hooks

        _install_worker_hooks()
    except ImportError:  # pragma: no cover - launcher package absent
        pass

__all__ = [
    "AuthError", "Backend", "CollectiveMismatch", "DeadlockError", "DistBackendError",
    "DistError", "DistNetworkError", "DistStoreError", "DistTimeout", "FileStore",
    "GradBucket", "GroupMember", "HashStore", "InvalidArgument", "Membership", "P2POp", "PeerFailure",
    "PeerTimeout", "PrefixStore",
    "ProcessGroup", "RecoveryError", "ReduceOp", "RendezvousError", "Store", "StoreError", "TCPStore", "Work",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "default_pg_timeout", "destroy_process_group", "gather", "gather_object", "get_backend",
    "get_backend_config", "get_default_backend_for_device", "get_global_rank",
    "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks",
    "get_rank", "get_world_size", "group", "grow", "init_process_group", "irecv", "is_available",
    "is_backend_available", "is_gloo_available", "is_initialized", "is_mpi_available",
    "is_nccl_available", "is_torchelastic_launched", "is_ucc_available", "is_xccl_available",
    "isend", "main_process_first", "membership", "monitored_barrier", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "rank_zero_first", "record_comm", "recv",
    "recv_object_list", "reduce",
    "reduce_op", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "send", "send_object_list", "shrink", "spawn", "stragglers", "supports_complex",
    "unwrap", "who_is_where",
]
