"""In-place recovery: after a ``PeerFailure`` the survivors go on in the same processes.

``shrink()`` agrees with every survivor on who is alive (``recovery.agreement``), drops
this process's broken data plane, and runs init's own rendezvous and engine choice again
among the survivors, in a fresh namespace of the same store; ``grow()`` does the same to
admit processes started with ``RANKWISE_JOIN=1``. Groups of the old world raise a clear
error naming the call that replaced it. What the user must restore (model, optimizer,
sampler, step) and what rankwise guarantees: docs/recovery.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from ..core.group import seconds
from ..core.work import stop_worker
from ..errors import DistError, InvalidArgument, PeerFailure
from ..recovery.agreement import Decision, agree_on_admission, agree_on_survivors, pid_of
from ..transport.mesh import exited_peers
from ..wire.frames import Kind
from .init import connect_world
from .leaving import _set_watcher
from .world import World, WorldSpec, current, retire, set_world

__all__ = ["Membership", "follow_rebuilds", "grow", "membership", "shrink"]

#: the default bound of the agreement (and of the new world's rendezvous), in seconds
RECOVERY_TIMEOUT = 60.0
#: how a rank that leaves to rebuild the world says goodbye (its peers do not count it dead)
_REBUILDING = "left to rebuild the world"
#: what else moves to each new world, called once the world is ready (``follow_rebuilds``)
_followers: list[Callable[[], None]] = []


def follow_rebuilds(hook: Callable[[], None]) -> None:
    """Call ``hook()`` after every ``shrink``/``grow`` that made a new world, on every
    member, before they return. Why: what was built over the old world from outside
    rankwise (``rankwise.torch``: torch's default group on backend "rankwise") has to be
    built again over the new one, and the user cannot tell which of it was rankwise's."""
    if hook not in _followers:
        _followers.append(hook)


@dataclass(frozen=True)
class Membership:
    """This process's place in the current world, and how the last change made it.

    ``previous_rank``: its rank before the change (None: it joined in it); ``lost``: ranks
    of the previous world that are gone; ``joined``: new ranks of admitted joiners."""

    generation: int
    rank: int
    world_size: int
    previous_rank: int | None = None
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    #: the launcher's RANK of every rank of this world
    launch_ranks: tuple[int, ...] = ()


def membership() -> Membership:
    """Where this process stands now (``joined`` names this rank when it joined late)."""
    world = current()
    rank, n = world.comm.rank, world.comm.world_size
    return Membership(world.generation, rank, n, None if world.joined else rank,
                      joined=(rank,) if world.joined else (),
                      launch_ranks=world.launch_ranks or tuple(range(n)))


def shrink(timeout: timedelta | float | None = None) -> Membership:
    """Go on with the ranks that are alive: every survivor calls it (after catching a
    ``PeerFailure``); it returns when the new world is ready, with new consecutive ranks
    in the old order. Raises ``RecoveryError`` when the survivors disagree about who is
    alive, or a rank no survivor reported dead does not join within ``timeout`` (60 s)."""
    world, plan, limit = _begin("shrink", timeout)
    comm = world.comm
    # the old connections stay open while the survivors agree: a rank seen dying late
    # (a node's second) joins this rank's view, and no survivor's close can pass for a
    # death (each says goodbye first, in ``_leave_for_rebuild``)
    _retire(world, "shrink")
    try:
        decision = agree_on_survivors(plan.base, world.generation, comm.rank,
                                      comm.world_size, lambda: _believed_dead(world), limit,
                                      exited=lambda: _exited(world),
                                      launch_ranks=_launch_ranks(world))
    except BaseException as exc:
        _leave_for_rebuild(world, "shrink")
        set_world(None, f"rankwise.shrink() failed: {type(exc).__name__}: {exc}")
        raise
    _leave_for_rebuild(world, "shrink")
    lost = tuple(r for r in range(comm.world_size) if r not in decision.members)
    if decision.members[0] == comm.rank:
        _record_losses(plan, world, lost)
    return _rebuild(world, plan, decision, decision.members.index(comm.rank),
                    len(decision.members), limit, lost=lost)


def grow(wait_for: int = 0, timeout: timedelta | float | None = None) -> Membership:
    """Admit the processes waiting to join (started with ``RANKWISE_JOIN=1``), at a step
    boundary: every rank of the world calls it at the same step. Rank 0 waits up to
    ``timeout`` until ``wait_for`` joiners wait, then admits all that do; with none, the
    world stays as it is (the call costs a few store requests). Joiners take the ranks
    after the current ones."""
    if not isinstance(wait_for, int) or isinstance(wait_for, bool) or wait_for < 0:
        raise InvalidArgument(f"grow: wait_for must be an int >= 0, got {wait_for!r}")
    world, plan, limit = _begin("grow", timeout)
    comm = world.comm
    decision = agree_on_admission(plan.base, world.generation, comm.rank, comm.world_size,
                                  world.admitted, wait_for, limit, _launch_ranks(world))
    if not decision.joiners:  # nobody to admit: the same world, one agreement further
        world.generation += 1
        return membership()
    _leave_for_rebuild(world, "grow")
    size = comm.world_size + len(decision.joiners)
    joined = tuple(range(comm.world_size, size))
    return _rebuild(world, plan, decision, comm.rank, size, limit, joined=joined)


def _begin(what: str, timeout: timedelta | float | None) -> tuple[World, WorldSpec, float]:
    world = current()
    if world.spec is None:
        raise InvalidArgument(f"rankwise.{what}() needs a world made by init_process_group "
                              "(this one was made by hand, e.g. by rankwise.testing)")
    limit = seconds(timeout, RECOVERY_TIMEOUT)
    if limit <= 0:
        raise InvalidArgument(f"{what}: timeout must be positive, got {timeout!r}")
    return world, world.spec, limit


def _launch_ranks(world: World) -> tuple[int, ...]:
    return world.launch_ranks or tuple(range(world.comm.world_size))


def _believed_dead(world: World) -> set[int]:
    """The ranks this process knows are gone: connections lost without a goodbye, the
    rank a failure names, peers that left (but not those leaving to rebuild too)."""
    comm = world.comm
    dead = set(comm.departures.lost)
    dead.update(r for r, where in comm.departures.bye.items() if _REBUILDING not in where)
    failure = comm.router.failure
    origin = getattr(failure, "rank", None)
    if isinstance(failure, PeerFailure) and isinstance(origin, int) and origin != comm.rank \
            and _REBUILDING not in str(getattr(failure, "departed_where", "")):
        dead.add(origin)
    dead.discard(comm.rank)
    return {r for r in dead if 0 <= r < comm.world_size}


def _exited(world: World) -> set[int]:
    """Ranks of ``world`` the launcher saw end: its notice names the pid, which must be
    the member's (a rank respawned under the same RANK is another process)."""
    launch = _launch_ranks(world)
    spec = world.spec
    assert spec is not None
    notices = exited_peers(spec.base, sorted(set(launch)))
    if not notices:
        return set()
    gone = set()
    for r, lr in enumerate(launch):
        text = notices.get(lr)
        if text is None:
            continue
        try:
            pid = pid_of(world.rendezvous.get(f"joined/{r}").decode("utf-8", "replace"))
        except DistError:
            pid = None
        if pid is None or pid == pid_of(text):
            gone.add(r)
    return gone


def _record_losses(plan: WorldSpec, world: World, lost: tuple[int, ...]) -> None:
    """Note the dropped ranks for the launcher (``lost/<i>``, by its RANK), which prints
    them and exits 3 at the end: a node whose ranks all went on knows no other way.
    Written once, by the new rank 0; best effort."""
    launch = _launch_ranks(world)
    try:
        for r in lost:
            i = int(plan.base.add("lost/count", 1)) - 1
            plan.base.set(f"lost/{i}", f"rank {launch[r]}: dropped by the survivors' "
                                       f"rankwise.shrink() (generation {world.generation})")
    except DistError:
        pass


def _retire(world: World, why: str) -> None:
    """From now on no call reaches ``world``: its groups say what replaced it, the process
    has no current world until the new one, and the store no longer raises the old
    world's failure (it serves the agreement next)."""
    retire(world, f"it belongs to the world of generation {world.generation}, which "
                  f"rankwise.{why}() replaced; use the new world's groups (make subgroups "
                  "again with new_group, and wrap the model in DistributedDataParallel again)")
    set_world(None, f"rankwise.{why}() is rebuilding the world of this process")
    _set_watcher(world.store, None)


def _leave_for_rebuild(world: World, why: str) -> None:
    """Drop this process's part of ``world`` without ending it: every group is retired
    (a call on one says what replaced it), the peers hear a goodbye that says this rank
    is alive and rebuilding, and the connections, engines and threads are closed."""
    comm = world.comm
    _retire(world, why)
    if comm.closed:
        return
    try:
        comm.sender.tell_everyone(Kind.BYE, f"{_REBUILDING} (rankwise.{why})".encode(),
                                  time.monotonic() + 1.0)
    except DistError:
        pass  # a dead peer: nothing to tell
    comm.departures.leaving = True
    comm.closed = True
    if comm.heartbeat is not None:
        comm.heartbeat.stop()
    for group in list(world.groups.values()):
        group.engine.close()
    comm.transport.close()
    stop_worker(owner=comm)


def _rebuild(old: World, plan: WorldSpec, decision: Decision, rank: int, size: int,
             limit: float, lost: tuple[int, ...] = (), joined: tuple[int, ...] = ()
             ) -> Membership:
    """Meet the agreed members in the next generation's namespace (init's rendezvous)."""
    generation = old.generation + 1
    try:
        new = connect_world(plan, generation, rank, size, limit)
    except BaseException as exc:
        set_world(None, f"rankwise.shrink/grow could not build the new world: "
                        f"{type(exc).__name__}: {exc}")
        raise
    new.launch_ranks = decision.launch_ranks
    new.admitted = old.admitted + len(decision.joiners)
    new.joined = old.joined
    for hook in _followers:
        hook()
    return Membership(generation, rank, size, old.comm.rank, lost, joined,
                      decision.launch_ranks)

