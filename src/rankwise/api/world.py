"""The process-wide state of an initialized job: communicator, groups, store.

Kept in one object behind ``current()`` so every API call fails the same clear way
before init, and ``destroy_process_group`` can tear everything down in one place.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from threading import get_ident
from typing import Any

from ..by_thread import ByThread
from ..core.communicator import Communicator
from ..core.group import ProcessGroup
from ..errors import InvalidArgument

__all__ = ["GroupMember", "World", "WorldSpec", "current", "resolve_group", "retire"]


class _NonMember:
    """What ``new_group`` returns on ranks outside the group (torch's NON_GROUP_MEMBER)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    WORLD: Any = None
    NON_GROUP_MEMBER = _NonMember()


@dataclass(frozen=True)
class WorldSpec:
    """What ``init_process_group`` resolved once and a rebuilt world reuses as is
    (``api.recovery``: shrink and grow re-run the rendezvous in the same store)."""

    store: Any
    #: the job's namespace in ``store`` (``rankwise/<restart>``): generation 0 meets
    #: here; later generations under ``gen/<g>``, their agreements under ``change/<g>``
    base: Any
    backend: str
    timeout: float
    bind: str
    secret: bytes | None
    device: Any = None
    device_id: Any = None
    group_name: str = ""


@dataclass
class World:
    comm: Communicator
    default_group: ProcessGroup
    store: Any
    #: the job's rendezvous namespace in ``store`` (per-group engine agreement uses it)
    rendezvous: Any
    backend: str
    timeout: float
    groups: dict[int, ProcessGroup] = field(default_factory=dict)
    group_counter: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``init_process_group``'s ``device_id``: NCCL groups made later use it too
    device_id: Any = None
    #: how to build this world again for new members (None: a world made by hand)
    spec: WorldSpec | None = None
    #: how many times the membership changed (shrink, grow) since init
    generation: int = 0
    #: the launcher's RANK of each rank of this world (exit notices are by that rank)
    launch_ranks: tuple[int, ...] = ()
    #: joiners admitted into the job so far (``grow``)
    admitted: int = 0
    #: this process entered the job as a joiner (``RANKWISE_JOIN=1``)
    joined: bool = False

    def register(self, group: ProcessGroup) -> None:
        self.groups[group.id] = group

    def next_group_id(self, ranks: list[int]) -> int:
        """Deterministic across ranks: every rank calls new_group in the same order."""
        self.group_counter += 1
        digest = zlib.crc32(",".join(map(str, ranks)).encode()) & 0xFFFF
        return ((self.group_counter << 16) | digest) & 0xFFFFFFFF

    def site_lookup(self, group_id: int, seq: int) -> Any:
        group = self.groups.get(group_id)
        return group.site_of(seq) if group is not None else None


_world: World | None = None


#: per-thread worlds (``testing.threads``: ranks as threads); they override the
#: process's. A ``ByThread``, not a ``threading.local``: every call asks, and a real
#: process (no thread-ranks) pays one truth test
_thread_worlds: ByThread[World] = ByThread()


#: why this process has no world although it had one (``api.recovery``), else ""
_why_none = ""


def current() -> World:
    world = _thread_worlds.mine() or _world
    if world is None:
        if _why_none:
            raise InvalidArgument(f"rankwise has no world in this process: {_why_none}")
        raise InvalidArgument(
            "rankwise is not initialized: call rankwise.init_process_group(...) first "
            "(or start the script with `rankwise run -n N script.py`)"
        )
    return world


def maybe_current() -> World | None:
    return _thread_worlds.mine() or _world


def set_thread_world(world: World | None) -> None:
    """Give the calling thread its own world (None: back to the process's)."""
    _thread_worlds.set_mine(world)


def set_world(world: World | None, why_none: str = "") -> None:
    """Make ``world`` this process's (None: none; ``why_none`` says why, when it is not
    "never initialized": a world given up by ``shrink``/``grow``)."""
    global _world, _why_none
    _world = world
    _why_none = why_none if world is None else ""
    GroupMember.WORLD = world.default_group if world is not None else None


def retire(world: World, why: str) -> None:
    """Mark every group of ``world`` as unusable for ``why`` (the world was replaced by
    ``shrink``/``grow``): a call on one raises that, not "destroyed"."""
    for group in world.groups.values():
        group.retired = why


def resolve_group(group: Any) -> ProcessGroup | None:
    """The group a call refers to; None when this rank is not a member (no-op call)."""
    # ``_thread_worlds.mine()`` written out; ``current`` raises for none
    world = (_thread_worlds.get(get_ident()) if _thread_worlds else None) or _world \
        or current()
    if group is None or group is GroupMember.WORLD:
        return world.default_group
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(group, ProcessGroup):
        if group.retired is not None:
            raise InvalidArgument(f"{group!r}: {group.retired}")
        if group.id not in world.groups:
            raise InvalidArgument(f"{group!r} was destroyed or belongs to an earlier init")
        return group
    raise InvalidArgument(f"group must be a rankwise ProcessGroup or None, got {group!r}")
