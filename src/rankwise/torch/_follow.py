"""torch's default group follows rankwise's world through ``shrink`` and ``grow``.

Why: a script on torch's own stack (``init_process_group("rankwise")``, torch's
``DistributedDataParallel``) holds torch's default group, a torch object over the rankwise
world ``shrink`` just replaced; its every call then raises "it belongs to the world of
generation 0". torch cannot renumber a group (its C++ ``ProcessGroup`` keeps the rank and
size it was made with), so the group is made again: torch's groups are destroyed (the old
world's are closed already; subgroups are the user's to make again, as with rankwise's
own) and torch's default group is made on backend "rankwise" over the new world, with the
new rank and size. ``dist.get_rank()``, ``dist.get_world_size()`` and a new torch DDP then
read the new world; nothing else changes for the user.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed import distributed_c10d as c10d

from ..api.world import current
from ._backend import BACKEND_NAME, TorchProcessGroup

__all__ = ["follow_world", "rankwise_backend_of"]


def rankwise_backend_of(pg: Any) -> TorchProcessGroup | None:
    """rankwise's half of torch group ``pg``: the group itself on the subclass route, its
    CPU backend under torch's own ``ProcessGroup`` (``_c10d.TorchBackend``); None when
    ``pg`` is another backend's."""
    if isinstance(pg, TorchProcessGroup):
        return pg
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return backend if getattr(backend, "rankwise_group", None) is not None else None


def follow_world() -> None:
    """After ``shrink``/``grow`` (``api.recovery.follow_rebuilds``): torch's default group
    again, over the new world, where it was rankwise's old world's; else nothing."""
    if not tdist.is_initialized():
        return
    ours = rankwise_backend_of(c10d._get_default_group())
    if ours is None or ours.group.retired is None:
        return  # another backend's group, or already over the current world
    owns, store = ours._owns_world, c10d._get_default_store()
    world = current()
    tdist.destroy_process_group()  # the old world's groups: their shutdown does nothing
    # the same store, in a namespace of this generation's: nothing torch wrote into the
    # old default group's keys can be read as the new one's
    tdist.init_process_group(
        BACKEND_NAME, store=c10d.PrefixStore(f"rankwise/gen{world.generation}", store),
        rank=world.comm.rank, world_size=world.comm.world_size,
        timeout=timedelta(seconds=world.default_group.timeout))
    new = rankwise_backend_of(c10d._get_default_group())
    assert new is not None
    new._owns_world = owns  # destroy_process_group() then leaves the job, as before
