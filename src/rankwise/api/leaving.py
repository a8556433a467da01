"""Leaving the job: ``destroy_process_group``, and the process hooks that say goodbye
for a rank that exits without it (at exit, or on an uncaught exception)."""

from __future__ import annotations

import atexit
import sys
import traceback
from datetime import timedelta
from types import TracebackType
from typing import Any

from ..core.work import stop_worker
from ..errors import (
    DistError,
    PeerFailure,
)
from ..identity.callsite import capture
from ..store.base import Watcher
from .world import GroupMember, World, current, maybe_current, set_world


def _set_watcher(store: Any, watcher: Watcher | None) -> None:
    """``Store.set_watcher``, where the job's store has it (a store passed in by the
    user may be of another kind: it is then not watched)."""
    set_watcher = getattr(store, "set_watcher", None)
    if callable(set_watcher):
        set_watcher(watcher)


# --- leaving ------------------------------------------------------------------------------

def destroy_process_group(group: Any = None) -> None:
    """Leave the job (no group) or forget one group. Peers still waiting on this rank
    are told where it left, instead of waiting for a timeout."""
    world = current()
    if group is not None and group is not GroupMember.WORLD and group is not world.default_group:
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        gone = world.groups.pop(getattr(group, "id", -1), None)
        if gone is not None:
            gone.engine.close()
        return
    site = capture()
    _leave(world, f"called destroy_process_group at {site.short}", linger=True)


#: how long the process hosting the store waits, when leaving, for the others to leave
LEAVE_LINGER = 10.0


def _leave(world: World, where: str, linger: bool = False) -> None:
    """Say goodbye and release everything. ``linger``: an explicit, healthy
    destroy_process_group, after which the store's host waits for the others to leave
    (at exit after an exception nobody waits: the others may be stuck or dead)."""

    clean = linger and world.comm.router.failure is None
    for group in list(world.groups.values()):
        group.engine.settle()  # ahead of the goodbye: a peer stops reading after it
    world.comm.goodbye(where)
    stop_worker(owner=world.comm)
    for group in list(world.groups.values()):
        group.engine.close()
    if clean:
        _let_the_others_leave(world)
    _set_watcher(world.store, None)  # the job is over: a plain store from here on
    close = getattr(world.store, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001, S110 - leaving must not fail on a dead store
            pass
    set_world(None)


def _let_the_others_leave(world: World) -> None:
    """Count this rank out; the process hosting the store then waits (bounded) until
    every rank has counted out, so no rank still reading the store (an engine agreement
    of a group it is finishing, its own leaving) finds it gone: "the store went away" on
    a peer of a job that ended well. Skipped after a failure: the others may be dead."""
    try:
        if int(world.rendezvous.add("left", 1)) >= world.comm.world_size:
            world.rendezvous.set("all-left", "1")
            if world.spec is not None:  # a process waiting to join (grow) waits no more
                world.spec.base.set("joiners/closed", "the job's ranks finished")
        if getattr(world.store, "server", None) is not None:
            world.rendezvous.wait(["all-left"], timedelta(seconds=LEAVE_LINGER))
    except DistError:
        pass  # a peer that never leaves, or a store already gone: leave anyway


# --- process hooks ----------------------------------------------------------------------

_hooks_installed = False
_previous_excepthook = sys.excepthook


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    world = maybe_current()
    if world is not None and not world.comm.closed:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        if isinstance(exc, PeerFailure) and exc.rank is not None:
            info = world.comm.relay_of(exc)  # secondary: name the rank that failed first
        else:
            info = {"kind": "exception", "rank": world.comm.rank,
                    "message": f"{exc_type.__name__}: {exc}"[:4000],
                    "traceback": text[-40000:], "last": world.comm.last_call,
                    "report": str(getattr(exc, "report", ""))[:100000]}
        try:
            world.comm.broadcast_abort(info)
        except Exception:  # noqa: BLE001, S110 - the original error matters more
            pass
        if world.comm.dumper is not None:
            world.comm.dumper.write(f"uncaught {exc_type.__name__}: {exc}")
    _previous_excepthook(exc_type, exc, tb)


def _at_exit() -> None:

    world = maybe_current()
    if world is not None and not world.comm.closed:
        _leave(world, "exited without calling destroy_process_group")
    stop_worker()  # never leave the async thread running into interpreter shutdown


def _install_hooks() -> None:
    global _hooks_installed, _previous_excepthook
    if _hooks_installed:
        return
    _hooks_installed = True
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
