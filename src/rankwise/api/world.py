"""The process-wide state of an initialized job: communicator, groups, store.

Kept in one object behind ``current()`` so every API call fails the same clear way
before init, and ``destroy_process_group`` can tear everything down in one place.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from ..core.communicator import Communicator
from ..core.group import ProcessGroup
from ..errors import InvalidArgument

__all__ = ["GroupMember", "World", "current", "resolve_group"]


class _NonMember:
    """What ``new_group`` returns on ranks outside the group (torch's NON_GROUP_MEMBER)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    WORLD: Any = None
    NON_GROUP_MEMBER = _NonMember()


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


class _ThreadWorld(threading.local):
    """A per-thread world overrides the process's (``testing.threads``: ranks as threads).

    ``world`` defaults to None on the class: ``getattr(local, "world", None)`` on a thread
    that never set it raised and formatted an AttributeError inside, on every call."""

    world: World | None = None


_thread_world = _ThreadWorld()


def current() -> World:
    world = _thread_world.world or _world
    if world is None:
        raise InvalidArgument(
            "rankwise is not initialized: call rankwise.init_process_group(...) first "
            "(or start the script with `rankwise run -n N script.py`)"
        )
    return world


def maybe_current() -> World | None:
    return _thread_world.world or _world


def set_thread_world(world: World | None) -> None:
    """Give the calling thread its own world (None: back to the process's)."""
    _thread_world.world = world


def set_world(world: World | None) -> None:
    global _world
    _world = world
    GroupMember.WORLD = world.default_group if world is not None else None


def resolve_group(group: Any) -> ProcessGroup | None:
    """The group a call refers to; None when this rank is not a member (no-op call)."""
    world = current()
    if group is None or group is GroupMember.WORLD:
        return world.default_group
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(group, ProcessGroup):
        if group.id not in world.groups:
            raise InvalidArgument(f"{group!r} was destroyed or belongs to an earlier init")
        return group
    raise InvalidArgument(f"group must be a rankwise ProcessGroup or None, got {group!r}")
