"""``new_subgroups`` and ``new_subgroups_by_enumeration``: many groups in one call.

Like torch, every rank of the job makes every subgroup (``new_group`` is collective) and
gets back the one it belongs to plus the whole list, where the subgroups it is not in are
``GroupMember.NON_GROUP_MEMBER``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from ..errors import InvalidArgument
from .init import new_group
from .world import GroupMember, current

__all__ = ["new_subgroups", "new_subgroups_by_enumeration"]


def new_subgroups(group_size: int | None = None, group: Any = None,
                  timeout: timedelta | float | None = None, backend: str | None = None,
                  pg_options: Any = None, group_desc: str | None = None
                  ) -> tuple[Any, list[Any]]:
    """Split the world into consecutive groups of ``group_size`` ranks.

    torch's default size is the number of GPUs per machine; rankwise's is the launcher's
    ranks per machine (``LOCAL_WORLD_SIZE``), the same intent: one subgroup per host.
    """
    if group is not None:
        raise InvalidArgument("new_subgroups: group= is not supported (torch ignores it "
                              "too); subgroups are cut from the whole world")
    world_size = current().comm.world_size
    if group_size is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None or not raw.isdigit():
            raise InvalidArgument("new_subgroups: pass group_size (LOCAL_WORLD_SIZE, the "
                                  "default, is not set)")
        group_size = int(raw)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgument(f"new_subgroups: group_size must be a positive int, got "
                              f"{group_size!r}")
    if group_size > world_size or world_size % group_size:
        raise InvalidArgument(f"new_subgroups: world size {world_size} is not a multiple of "
                              f"group_size {group_size}")
    ranks = [list(range(s, s + group_size)) for s in range(0, world_size, group_size)]
    return new_subgroups_by_enumeration(ranks, timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: list[list[int]],
                                 timeout: timedelta | float | None = None,
                                 backend: str | None = None, pg_options: Any = None,
                                 group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """One group per list of ranks; a rank may be in at most one of them."""
    if not ranks_per_subgroup_list:
        raise InvalidArgument("new_subgroups_by_enumeration: the list of subgroups is empty")
    world_size = current().comm.world_size
    seen: dict[int, int] = {}
    for i, ranks in enumerate(ranks_per_subgroup_list):  # all of it before any new_group
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise InvalidArgument(f"new_subgroups_by_enumeration: rank {r!r} of subgroup "
                                      f"{i} is not in 0..{world_size - 1}")
            if r in seen:
                raise InvalidArgument(f"new_subgroups_by_enumeration: rank {r} is in "
                                      f"subgroup {seen[r]} and subgroup {i}")
            seen[r] = i
    me = current().comm.rank
    mine: Any = GroupMember.NON_GROUP_MEMBER
    made = []
    for i, ranks in enumerate(ranks_per_subgroup_list):
        desc = f"{group_desc or 'subgroup'} {i}"
        g = new_group(list(ranks), timeout, backend, pg_options, group_desc=desc)
        made.append(g)
        if me in ranks:
            mine = g
    return mine, made
