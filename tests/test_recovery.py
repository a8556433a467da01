"""In-place recovery, in-process: the store agreement of shrink and grow (ranks as
threads over one ``HashStore``), old groups refused after a change, misuse refused before
any I/O, and the launcher's options. Real processes: ``test_recovery_procs.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import rankwise
from rankwise.api.world import current, resolve_group, retire, set_thread_world, set_world
from rankwise.cli import parse_run_args
from rankwise.errors import InvalidArgument, RecoveryError
from rankwise.recovery.agreement import (
    Decision,
    agree_on_admission,
    agree_on_survivors,
    await_ticket,
    propose_survivors,
    request_admission,
)
from rankwise.store import HashStore
from rankwise.testing.threads import run_threads
from rankwise.transport.memory import MemoryHub

BOUND = 10.0  #: every thread is joined within this; a hang fails the test


def _run(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Run each call on a thread of its own; its result or exception, by key."""
    out: dict[int, Any] = {}

    def body(key: int, call: Callable[[], Any]) -> None:
        try:
            out[key] = call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out[key] = exc

    threads = [threading.Thread(target=body, args=kv, daemon=True) for kv in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert not any(t.is_alive() for t in threads), "an agreement did not finish"
    return out


def _survivor(store: HashStore, rank: int, dead: set[int], n: int = 4, timeout: float = 5.0,
              exited: Callable[[], set[int]] = set) -> Callable[[], Decision]:
    return lambda: agree_on_survivors(store, 0, rank, n, dead, timeout, exited=exited)


# --- shrink --------------------------------------------------------------------------

def test_survivors_agree_on_the_same_world_without_the_dead_rank() -> None:
    store = HashStore()
    out = _run({r: _survivor(store, r, {2}) for r in (0, 1, 3)})
    assert {out[r] for r in out} == {Decision("shrink", (0, 1, 3), launch_ranks=(0, 1, 3))}


def test_a_dead_rank_only_one_survivor_heard_of_is_not_waited_for() -> None:
    # a node lost ranks 2 and 3; the failure named 2 to everyone, only rank 1 saw 3 go
    store = HashStore()
    out = _run({0: _survivor(store, 0, {2}), 1: _survivor(store, 1, {2, 3})})
    assert out[0] == out[1] == Decision("shrink", (0, 1), launch_ranks=(0, 1))


def test_a_death_seen_while_agreeing_is_published_and_ends_the_wait() -> None:
    # a node lost ranks 2 and 3; each survivor saw only 2 die when it called shrink, and
    # rank 0 sees 3's connection close a little later
    store = HashStore()
    looks = {"n": 0}

    def rank0_view() -> set[int]:
        looks["n"] += 1
        return {2} if looks["n"] < 3 else {2, 3}

    out = _run({0: lambda: agree_on_survivors(store, 0, 0, 4, rank0_view, 5.0),
                1: _survivor(store, 1, {2})})
    assert out[0] == out[1] == Decision("shrink", (0, 1), launch_ranks=(0, 1))


def test_the_launchers_exit_notice_ends_the_wait_for_a_rank_nobody_saw_die() -> None:
    store = HashStore()
    out = _run({r: _survivor(store, r, {2}, exited=lambda: {3}) for r in (0, 1)})
    assert out[0].members == out[1].members == (0, 1)


def test_a_rank_nobody_reported_dead_that_never_comes_is_named_at_the_timeout() -> None:
    store = HashStore()
    out = _run({r: _survivor(store, r, {2}, timeout=0.3) for r in (0, 1)})
    for r in (0, 1):
        assert isinstance(out[r], RecoveryError)
        assert "ranks [3] did not join the shrink within 0.3s" in str(out[r])
        assert "every surviving rank must call rankwise.shrink()" in str(out[r]).lower()


def test_survivors_that_disagree_about_who_is_alive_all_raise_naming_both() -> None:
    store = HashStore()
    # rank 1 checks in first; then rank 0, which believes rank 1 died
    first = _run({1: _survivor(store, 1, set(), n=3, timeout=0.2)})
    assert isinstance(first[1], RecoveryError)  # alone, it times out waiting for 0 and 2
    out = _run({0: _survivor(store, 0, {1}, n=3), 2: _survivor(store, 2, set(), n=3)})
    for r in (0, 2):
        assert isinstance(out[r], RecoveryError), out[r]
        assert "disagree about who is alive" in str(out[r])
        assert "rank 0 believes rank 1 died, but rank 1" in str(out[r])
    late = _run({1: _survivor(store, 1, set(), n=3)})
    assert "disagree about who is alive" in str(late[1])  # one decision, the same for all


def test_a_rank_arriving_after_a_decision_that_left_it_out_is_told_so() -> None:
    store = HashStore()
    out = _run({r: _survivor(store, r, {2}) for r in (0, 1, 3)})
    assert out[0].members == (0, 1, 3)
    late = _run({2: _survivor(store, 2, set())})
    assert isinstance(late[2], RecoveryError)
    assert "rank 2 was left out of the new world" in str(late[2])
    assert "ranks [0, 1, 3] reported it dead" in str(late[2])


def test_a_proposal_waits_for_every_rank_nobody_reported_dead() -> None:
    views: dict[int, dict[str, Any]] = {0: {"dead": [3]}, 1: {"dead": []}}
    assert propose_survivors(views, set(), 4, (0, 1, 2, 3)) is None  # rank 2 still to come
    views[2] = {"dead": []}
    assert propose_survivors(views, set(), 4, (10, 11, 12, 13)) == \
        Decision("shrink", (0, 1, 2), launch_ranks=(10, 11, 12))


# --- grow ----------------------------------------------------------------------------

def test_grow_admits_the_waiting_joiner_with_the_next_rank() -> None:
    store = HashStore()

    def joiner() -> Any:
        return await_ticket(store, request_admission(store, launch_rank=2), BOUND)

    calls: dict[int, Callable[[], Any]] = {
        r: (lambda r=r: agree_on_admission(store, 1, r, 3, 0, 1, 5.0, (0, 1, 3)))
        for r in range(3)}
    calls[9] = joiner
    out = _run(calls)
    decisions = {out[r] for r in range(3)}
    assert decisions == {Decision("grow", (0, 1, 2), (0,), (0, 1, 3, 2))}
    ticket = out[9]
    assert (ticket.generation, ticket.rank, ticket.world_size, ticket.admitted) == (2, 3, 4, 1)
    assert ticket.launch_ranks == (0, 1, 3, 2)


def test_grow_with_nobody_waiting_keeps_the_world() -> None:
    store = HashStore()
    out = _run({r: (lambda r=r: agree_on_admission(store, 0, r, 2, 0, 0, 1.0)) for r in range(2)})
    assert out[0] == out[1] == Decision("grow", (0, 1), (), (0, 1))


def test_a_joiner_nobody_admits_is_told_why_within_its_timeout() -> None:
    with pytest.raises(RecoveryError, match="admit joiners only when they call rankwise.grow"):
        await_ticket(HashStore(), 0, 0.2)


def test_a_joiner_stops_waiting_when_the_job_finished_without_admitting_it() -> None:
    store = HashStore()
    number = request_admission(store, launch_rank=1)
    store.set("joiners/closed", "the job's ranks finished")
    with pytest.raises(RecoveryError, match="finished without admitting it"):
        await_ticket(store, number, BOUND)


def test_ranks_that_make_different_changes_are_told() -> None:
    store = HashStore()
    store.set("change/0/decision", Decision("grow", (0, 1)).encode())
    with pytest.raises(RecoveryError, match="called rankwise.grow"):
        agree_on_survivors(store, 0, 0, 2, set(), 1.0)


# --- the old world's groups, and misuse ----------------------------------------------------

def test_groups_of_a_replaced_world_raise_naming_the_call_that_replaced_it() -> None:
    from rankwise.testing.threads import _world

    old = _world(0, 1, MemoryHub(1), 5.0)
    new = _world(0, 1, MemoryHub(1), 5.0)
    retire(old, "it belongs to the world of generation 0, which rankwise.shrink() replaced")
    set_thread_world(new)
    try:
        assert resolve_group(new.default_group) is new.default_group
        with pytest.raises(InvalidArgument, match=r"rankwise\.shrink\(\) replaced"):
            resolve_group(old.default_group)
    finally:
        set_thread_world(None)
        for w in (old, new):
            w.comm.closed = True
            w.comm.transport.close()


def test_a_process_without_a_world_says_the_shrink_gave_it_up() -> None:
    set_world(None, "rankwise.shrink() could not build the new world: RecoveryError: x")
    try:
        with pytest.raises(InvalidArgument, match="shrink.. could not build the new world"):
            current()
    finally:
        set_world(None)


def test_shrink_and_grow_refuse_misuse_before_any_io() -> None:
    def body(rank: int, n: int) -> list[str]:
        errors = []
        for call in (lambda: rankwise.shrink(), lambda: rankwise.grow(wait_for=-1),
                     lambda: rankwise.shrink(timeout=0)):
            try:
                call()
            except InvalidArgument as exc:
                errors.append(str(exc))
        return errors

    errors = run_threads(body, 2)[0]
    assert len(errors) == 3
    assert "needs a world made by init_process_group" in errors[0]
    assert "wait_for must be an int >= 0" in errors[1]


def test_membership_of_a_fresh_world() -> None:
    got = run_threads(lambda rank, n: rankwise.membership(), 2)
    assert [(m.rank, m.world_size, m.generation, m.joined) for m in got] == \
        [(0, 2, 0, ()), (1, 2, 0, ())]


# --- the launcher's options ------------------------------------------------------------------

def test_on_failure_defaults_to_stop_and_respawn_needs_continue() -> None:
    assert parse_run_args(["x.py"]).on_failure == "stop"
    opts = parse_run_args(["--on-failure=continue", "--respawn", "2", "x.py"])
    assert (opts.on_failure, opts.respawn) == ("continue", 2)
    with pytest.raises(SystemExit):
        parse_run_args(["--respawn", "1", "x.py"])
    with pytest.raises(SystemExit):
        parse_run_args(["--on-failure=retry", "x.py"])
