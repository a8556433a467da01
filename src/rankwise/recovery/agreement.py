"""Agreeing on the next membership over the job's store: who survived (shrink), who
joins (grow). Store operations only, no sockets, so the protocol is tested with ranks
as threads over a ``HashStore``.

Why the store: after a failure the data plane is broken, but every survivor still
reaches the store, and its ``compare_set`` is linearizable: the first complete
proposal written under ``change/<generation>/decision`` is the one every rank reads
(MPI ULFM's ``MPI_Comm_agree`` gives the same guarantee with a consensus among the
processes; a store we already depend on makes it one key). The rules (docs/recovery.md):

- shrink: each survivor checks in (``here/<rank>``) with the ranks it knows died. A
  proposal exists once every rank that nobody reported dead has checked in; it keeps
  exactly those. A rank reported dead by one survivor that checked in itself is a
  disagreement: the decision is then "conflict" and every rank raises, naming both.
- grow: rank 0 of the running world snapshots the joiners waiting (``joiners/count``)
  and writes the decision; the others read it; each admitted joiner gets a ticket.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

from ..errors import DistError, DistTimeout, RecoveryError

__all__ = ["Decision", "Ticket", "agree_on_admission", "agree_on_survivors",
           "await_ticket", "identity", "request_admission"]

#: seconds between looks at who has checked in (a decision wakes the waiters at once)
POLL = 0.05


class Store(Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None: ...


def identity() -> str:
    """How a process is named in messages: host and pid."""
    return f"{socket.gethostname()} pid {os.getpid()}"


@dataclass(frozen=True)
class Decision:
    """What every rank of generation ``g`` read from ``change/<g>/decision``.

    ``members``: the old ranks that go on, in order (new rank = index); ``joiners``: the
    admitted joiners' numbers (their new ranks follow the members'); ``launch_ranks``:
    the launcher's RANK of every new rank (how the launcher's exit notices are read)."""

    kind: str  # "shrink" | "grow" | "conflict"
    members: tuple[int, ...] = ()
    joiners: tuple[int, ...] = ()
    launch_ranks: tuple[int, ...] = ()
    reason: str = ""

    def encode(self) -> str:
        return json.dumps({"kind": self.kind, "members": list(self.members),
                           "joiners": list(self.joiners),
                           "launch_ranks": list(self.launch_ranks), "reason": self.reason})

    @staticmethod
    def decode(raw: bytes) -> Decision:
        data = json.loads(raw.decode("utf-8", "replace"))
        return Decision(str(data["kind"]), tuple(int(r) for r in data["members"]),
                        tuple(int(j) for j in data["joiners"]),
                        tuple(int(r) for r in data["launch_ranks"]), str(data["reason"]))


def _base(generation: int) -> str:
    return f"change/{generation}"


def _read_decision(store: Store, generation: int) -> Decision | None:
    key = f"{_base(generation)}/decision"
    return Decision.decode(store.get(key)) if store.check([key]) else None


def _decide(store: Store, generation: int, proposal: Decision) -> Decision:
    """Write ``proposal`` unless another rank decided first; the decision either way."""
    won = store.compare_set(f"{_base(generation)}/decision", "", proposal.encode())
    return Decision.decode(won)


# --- shrink ----------------------------------------------------------------------------

def _views(store: Store, generation: int, world_size: int) -> dict[int, dict[str, Any]]:
    base = _base(generation)
    views: dict[int, dict[str, Any]] = {}
    for r in range(world_size):
        key = f"{base}/here/{r}"
        if store.check([key]):
            views[r] = json.loads(store.get(key).decode("utf-8", "replace"))
    return views


def _known_views(seen: dict[int, dict[str, Any]], store: Store, generation: int,
                 world_size: int) -> dict[int, dict[str, Any]]:
    return seen or _views(store, generation, world_size)


def propose_survivors(views: dict[int, dict[str, Any]], exited: set[int], world_size: int,
                      launch_ranks: tuple[int, ...]) -> Decision | None:
    """The shrink decision the check-ins so far support, or None while a rank that no
    one reported dead has not checked in (pure: the rules of the module docstring)."""
    dead: dict[int, list[int]] = {}  # dead rank -> who reported it
    for r, view in views.items():
        for d in view.get("dead", []):
            dead.setdefault(int(d), []).append(r)
    accused = sorted(set(dead) & set(views))
    if accused:
        lines = [f"rank {', '.join(map(str, by))} believe{'s' if len(by) == 1 else ''} "
                 f"rank {d} died, but rank {d} ({views[d].get('who', '?')}) joined the shrink"
                 for d in accused for by in [dead[d]]]
        return Decision("conflict", reason=(
            "the survivors disagree about who is alive: " + "; ".join(lines) + ". A rank "
            "some survivors could not reach is not safe to keep or to drop: restart the job "
            "(rankwise run --max-restarts) or check the network between those ranks"))
    gone = set(dead) | exited
    awaited = [r for r in range(world_size) if r not in gone]
    if not all(r in views for r in awaited):
        return None
    return Decision("shrink", tuple(awaited),
                    launch_ranks=tuple(launch_ranks[r] for r in awaited))


def agree_on_survivors(store: Store, generation: int, rank: int, world_size: int,
                       believed_dead: set[int] | Callable[[], set[int]], timeout: float,
                       exited: Callable[[], set[int]] = set,
                       launch_ranks: tuple[int, ...] | None = None) -> Decision:
    """Check in as a survivor of generation ``generation`` and return the agreed shrink
    (every caller gets the same one), or raise ``RecoveryError``: the survivors disagree,
    a rank nobody reported dead did not check in within ``timeout`` seconds, or this
    rank was left out. ``believed_dead``: the ranks this rank knows died, or a function
    polled while waiting (a node's second rank may be seen dying only after the first);
    each new one is published. ``exited``: ranks the launcher saw end (polled too)."""
    launch = tuple(range(world_size)) if launch_ranks is None else launch_ranks
    base = _base(generation)
    known = believed_dead if callable(believed_dead) else (lambda: set(believed_dead))
    published: set[int] | None = None
    deadline = time.monotonic() + timeout
    while True:
        dead = known()
        if dead != published:
            published = dead
            store.set(f"{base}/here/{rank}", json.dumps({"dead": sorted(dead),
                                                          "who": identity()}))
        decision = _read_decision(store, generation)
        views: dict[int, dict[str, Any]] = {}
        if decision is None:
            views = _views(store, generation, world_size)
            proposal = propose_survivors(views, exited(), world_size, launch)
            if proposal is not None:
                decision = _decide(store, generation, proposal)
        if decision is not None:
            return _accept(decision, rank, "shrink",
                           partial(_known_views, views, store, generation, world_size))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _late(views, world_size, timeout, rank)
        try:
            store.wait([f"{base}/decision"], timedelta(seconds=min(POLL, remaining)))
        except DistTimeout:
            pass


def _late(views: dict[int, dict[str, Any]], world_size: int, timeout: float,
          rank: int) -> RecoveryError:
    reported = sorted({int(d) for v in views.values() for d in v.get("dead", [])})
    missing = [r for r in range(world_size) if r not in views and r not in reported]
    return RecoveryError(
        f"rankwise.shrink on rank {rank}: ranks {missing} did not join the shrink within "
        f"{timeout:g}s, and no survivor reported them dead (ranks {sorted(views)} joined; "
        f"reported dead: {reported}). Every surviving rank must call rankwise.shrink() "
        "after the failure: is one of them still computing, or stuck outside rankwise?")


def _accept(decision: Decision, rank: int, asked: str,
            views: Callable[[], dict[int, dict[str, Any]]] = dict) -> Decision:
    """This rank's part of ``decision``, or the error that says why it has none."""
    if decision.kind == "conflict":
        raise RecoveryError(f"rankwise.{asked} on rank {rank}: {decision.reason}")
    if decision.kind != asked:
        raise RecoveryError(
            f"rankwise.{asked} on rank {rank}: the other ranks called rankwise."
            f"{decision.kind}() at this point; every rank must make the same call")
    if rank not in decision.members:
        by = sorted(r for r, v in views().items() if rank in v.get("dead", []))
        why = f"ranks {by} reported it dead" if by else "it joined after the decision"
        raise RecoveryError(
            f"rankwise.{asked}: rank {rank} was left out of the new world (ranks "
            f"{list(decision.members)} go on): {why}. This process cannot rejoin by itself: "
            "end it, or start it again as a joiner (RANKWISE_JOIN=1) for rankwise.grow()")
    return decision


# --- grow --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ticket:
    """What an admitted joiner needs to meet the world: where and as whom."""

    generation: int
    rank: int
    world_size: int
    admitted: int  #: joiners admitted in the job so far, this one included
    launch_ranks: tuple[int, ...] = field(default=())


def request_admission(store: Store, launch_rank: int) -> int:
    """Ask to join the running world; the number to wait for a ticket under."""
    number = int(store.add("joiners/count", 1)) - 1
    store.set(f"joiners/{number}", json.dumps({"who": identity(), "launch_rank": launch_rank}))
    return number


def await_ticket(store: Store, number: int, timeout: float) -> Ticket:
    """Wait (bounded) until the running world admits joiner ``number``; raise at once
    when its ranks finished without (``joiners/closed``, set by the last to leave)."""
    key = f"joiners/{number}/ticket"
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.wait([key], timedelta(seconds=max(0.05, min(_LOOK, deadline - time.monotonic()))))
            break
        except DistTimeout:
            if store.check(["joiners/closed"]) and not store.check([key]):
                raise RecoveryError(
                    f"this process asked to join the running job (joiner #{number}, "
                    "RANKWISE_JOIN=1), but its ranks finished without admitting it "
                    "(they admit joiners only when they call rankwise.grow())") from None
            if time.monotonic() >= deadline:
                raise RecoveryError(
                    f"this process asked to join the running job (joiner #{number}, "
                    f"RANKWISE_JOIN=1) and was not admitted within {timeout:g}s: the running "
                    "ranks admit joiners only when they call rankwise.grow() at a step "
                    "boundary") from None
    data = json.loads(store.get(key).decode("utf-8", "replace"))
    return Ticket(int(data["generation"]), int(data["rank"]), int(data["world_size"]),
                  int(data["admitted"]), tuple(int(r) for r in data["launch_ranks"]))


#: seconds between a joiner's looks at whether the job ended without admitting it
_LOOK = 0.5


def agree_on_admission(store: Store, generation: int, rank: int, world_size: int,
                       admitted: int, wait_for: int, timeout: float,
                       launch_ranks: tuple[int, ...] | None = None) -> Decision:
    """The agreed grow of generation ``generation``: rank 0 waits (at most ``timeout``)
    until ``wait_for`` joiners are waiting, admits all that are, and hands each its
    ticket; the others read the decision. ``admitted``: joiners admitted before."""
    launch = tuple(range(world_size)) if launch_ranks is None else launch_ranks
    deadline = time.monotonic() + timeout
    if rank == 0:
        pending = _pending(store, admitted)
        while pending < wait_for and time.monotonic() < deadline:
            time.sleep(POLL)
            pending = _pending(store, admitted)
        joiners = tuple(range(admitted, admitted + pending))
        asks = [json.loads(store.get(f"joiners/{j}").decode("utf-8", "replace"))
                for j in joiners]
        decision = _decide(store, generation, Decision(
            "grow", tuple(range(world_size)), joiners,
            launch + tuple(int(a.get("launch_rank", -1)) for a in asks)))
        for k, j in enumerate(decision.joiners):
            store.set(f"joiners/{j}/ticket", json.dumps({
                "generation": generation + 1, "rank": world_size + k,
                "world_size": world_size + len(decision.joiners),
                "admitted": admitted + len(decision.joiners),
                "launch_ranks": list(decision.launch_ranks)}))
        return _accept(decision, rank, "grow")
    try:
        store.wait([f"{_base(generation)}/decision"],
                   timedelta(seconds=max(0.05, deadline - time.monotonic()) + timeout))
    except DistTimeout:
        raise RecoveryError(
            f"rankwise.grow on rank {rank}: rank 0 made no decision within {2 * timeout:g}s; "
            "every rank must call rankwise.grow() at the same step") from None
    decided = _read_decision(store, generation)
    assert decided is not None
    return _accept(decided, rank, "grow")


def _pending(store: Store, admitted: int) -> int:
    try:
        return max(0, int(store.add("joiners/count", 0)) - admitted)
    except (DistError, ValueError):
        return 0


def pid_of(text: str) -> int | None:
    """The pid in a "host pid N" identity or a launcher's exit notice."""
    found = re.search(r"pid (\d+)", text)
    return int(found.group(1)) if found else None
