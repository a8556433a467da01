"""The deadlock prober (issue 29): one rank per job looks, told by the waiting ranks.

In-process: the notes' bookkeeping and the prober's choices against a fake communicator,
then thread-ranks over the in-memory transport, where a real deadlock must be found by
rank 0's looks alone and a rank that computes must cost the waiters no look at all.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.checks import prober as prober_mod
from rankwise.checks.prober import MAX_BACKOFF, POLL, DeadlockWatch, Notes, call_id
from rankwise.checks.where import WhereService
from rankwise.errors import DeadlockError, DistError
from rankwise.testing.threads import run_threads
from rankwise.wire.frames import Kind, decode_header

pytestmark = pytest.mark.timeout(60)


def _rep(rank: int, since: float | None, **kw: Any) -> dict[str, Any]:
    """A who-is-where report: blocked in a call begun at ``since`` (None: computing)."""
    if since is None:
        return {"rank": rank, "op": "", "blocked": {"since": 0.0, "seqs": {}, "async": 0}}
    return {"rank": rank, "op": "recv", "kind": "recv", "waiting_for": (rank + 1) % 3,
            "blocked": {"since": since, "seqs": {"0": 1}, "async": 0}, **kw}


# --- the notes --------------------------------------------------------------------------

def test_call_id_survives_the_json_of_a_report() -> None:
    since = time.time()
    assert call_id(json.loads(json.dumps({"s": since}))["s"]) == call_id(since)
    assert call_id(None) == call_id("x") == call_id(float("nan")) == -1


def test_a_look_is_due_when_every_live_rank_noted_and_something_is_new() -> None:
    notes = Notes()
    notes.note(0, 10)
    notes.note(1, 11)
    assert not notes.due([0, 1, 2], 0)  # rank 2 has not said it is blocked
    notes.note(2, 12)
    assert notes.due([0, 1, 2], 0)
    mark = notes.mark()
    notes.note(2, 12)  # the same call again (a wait's back-off): no news
    assert not notes.due([0, 1, 2], mark)
    assert notes.due([0, 1], 0)  # a rank that left no longer counts


def test_a_look_forgets_ranks_that_moved_on_but_not_notes_that_came_during_it() -> None:
    notes = Notes()
    for r in range(3):
        notes.note(r, call_id(100.0 + r))
    mark = notes.mark()
    notes.note(2, call_id(200.0))  # rank 2 blocked again while the look was running
    notes.seen({0: _rep(0, 100.0), 1: _rep(1, None), 2: _rep(2, 102.0)}, mark)
    assert not notes.due([0, 2], notes.mark())
    assert not notes.due([0, 1, 2], mark)  # rank 1 computes: forgotten
    assert notes.due([0, 2], mark)  # rank 2's newer note survived the look
    notes.note(1, call_id(300.0))
    assert notes.due([0, 1, 2], mark)


def test_a_look_enters_ranks_it_shows_blocked_as_old_news() -> None:
    notes = Notes()
    notes.note(0, call_id(100.0))
    mark = notes.mark()
    notes.seen({0: _rep(0, 100.0), 1: _rep(1, 101.0)}, mark)  # rank 1 never notes
    assert not notes.due([0, 1], mark)  # in the book, but no news
    notes.note(0, call_id(110.0))
    assert notes.due([0, 1], mark)


# --- the prober's choices, against a fake communicator ---------------------------------

class _Router:
    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.gone: dict[int, BaseException] = {}

    def peer_gone(self, rank: int) -> BaseException | None:
        return self.gone.get(rank)

    def fail_all(self, exc: BaseException) -> None:
        self.failure = exc


class _Comm:
    """What ``DeadlockWatch`` reaches of a communicator, with the looks scripted."""

    def __init__(self, rank: int, world_size: int = 3) -> None:
        self.rank, self.world_size, self.closed = rank, world_size, False
        self.router = _Router()
        self.departures = type("D", (), {"bye": {}})()
        self.activity = type("A", (), {"since": 1000.0 + rank})()
        self.transport = self
        self.sent: list[tuple[int, Any]] = []
        self.looks: list[dict[int, dict[str, Any]]] = []  #: what each look answers
        self.asked = 0
        self.aborts: list[dict[str, Any]] = []

    def send(self, dst: int, header: bytes, payload: Any, deadline: float) -> None:
        self.sent.append((dst, decode_header(header)))

    def where_is_everyone(self, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
        self.asked += 1
        return self.looks[min(self.asked, len(self.looks)) - 1]

    def broadcast_abort(self, info: dict[str, Any]) -> None:
        self.aborts.append(info)


def _watch(comm: _Comm) -> DeadlockWatch:
    return DeadlockWatch(comm)  # type: ignore[arg-type]


def test_the_prober_is_the_lowest_live_rank() -> None:
    comm = _Comm(3, world_size=5)
    watch = _watch(comm)
    assert watch.prober() == 0
    comm.departures.bye[0] = "exited at the end of main"
    comm.router.gone[1] = DistError("lost")
    assert watch.prober() == 2
    assert watch.live() == [2, 3, 4]
    comm.router.gone[2] = DistError("lost")
    assert watch.prober() == 3  # itself


def test_other_ranks_only_note_the_prober_and_never_look() -> None:
    comm = _Comm(2)
    watch = _watch(comm)
    assert watch.probe(1.0) == 1.0
    assert watch.probe(5.0) == 5.0  # the wait's doubling back-off
    assert watch.probe(100.0) == MAX_BACKOFF
    assert comm.asked == 0
    assert [(dst, f.kind, f.tag, f.payload_len) for dst, f in comm.sent] == \
        [(0, Kind.BLOCKED, call_id(1002.0), 0)] * 3


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch_at(comm: _Comm) -> tuple[DeadlockWatch, _Clock]:
    watch, clock = _watch(comm), _Clock()
    watch.clock = clock
    return watch, clock


def test_the_prober_looks_when_every_rank_noted_and_on_its_own_back_off() -> None:
    comm = _Comm(0)
    watch, clock = _watch_at(comm)
    # rank 1 computes: conclusive looks, no deadlock
    comm.looks = [{0: _rep(0, 1000.0), 1: _rep(1, None), 2: _rep(2, 1002.0)}]
    watch.on_note(2, call_id(1002.0))
    watch.probe(1.0)
    assert comm.asked == 1  # the first probe of the prober's call looks
    for clock.now in (0.2, 0.4, 0.6):  # glances: no news, the back-off (1 s) not due
        assert watch.probe(1.0 + clock.now) == POLL
    assert comm.asked == 1
    watch.on_note(1, call_id(1001.0))  # rank 1 blocked at last: every rank noted
    clock.now = 0.8
    watch.probe(1.8)
    assert comm.asked == 2
    clock.now = 2.7
    watch.probe(3.7)
    assert comm.asked == 2
    clock.now = 2.8  # the back-off: 2 s after the last look
    watch.probe(3.8)
    assert comm.asked == 3
    assert comm.router.failure is None and not comm.sent


def test_the_prober_s_own_call_looks_backing_off_to_max_backoff() -> None:
    comm = _Comm(0)
    watch, clock = _watch_at(comm)
    comm.looks = [{0: _rep(0, 1000.0), 1: _rep(1, None), 2: _rep(2, None)}]
    looked = []
    for clock.now in (0, 0.5, 1, 2, 3, 6, 7, 14, 15, 30, 31, 60, 61, 91):
        before = comm.asked
        watch.probe(1.0 + clock.now)  # two threads may wait: their durations differ
        watch.probe(1.0)
        if comm.asked > before:
            looked.append(clock.now)
    assert comm.asked == len(looked)
    assert looked == [0, 1, 3, 7, 15, 31, 61, 91]
    comm.activity.since = 2000.0  # a new call starts over
    watch.probe(1.0)
    assert comm.asked == len(looked) + 1


def test_an_inconclusive_look_is_retried_backing_off_not_on_every_glance() -> None:
    comm = _Comm(0)
    watch = _watch(comm)
    comm.looks = [{0: _rep(0, 1000.0), 1: {"rank": 1, "no_answer": True},
                   2: _rep(2, 1002.0)}]
    watch.on_note(1, call_id(1001.0))
    watch.on_note(2, call_id(1002.0))
    watch.probe(1.0)
    watch.probe(1.2)
    assert comm.asked == 1  # the next try waits out ``after`` (1 s), then doubles


def test_a_confirmed_deadlock_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prober_mod, "CONFIRM_GAP", 0.0)
    comm = _Comm(0)
    watch = _watch(comm)
    cycle = {r: _rep(r, 1000.0 + r, site="prog.py:7") for r in range(3)}
    comm.looks = [cycle, cycle]
    watch.on_note(1, call_id(1001.0))
    watch.on_note(2, call_id(1002.0))
    watch.probe(1.0)
    assert comm.asked == 2  # two agreeing looks
    assert isinstance(comm.router.failure, DeadlockError)
    assert "rank 0 -> rank 1 -> rank 2 -> rank 0" in str(comm.router.failure)
    assert comm.aborts and comm.aborts[0]["kind"] == "deadlock"


def test_two_looks_that_disagree_are_no_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prober_mod, "CONFIRM_GAP", 0.0)
    comm = _Comm(0)
    watch = _watch(comm)
    cycle = {r: _rep(r, 1000.0 + r) for r in range(3)}
    comm.looks = [cycle, {**cycle, 1: _rep(1, 1005.0)}]  # rank 1 moved
    watch.on_note(1, call_id(1001.0))
    watch.on_note(2, call_id(1002.0))
    watch.probe(1.0)
    assert comm.asked == 2 and comm.router.failure is None


# --- thread-ranks over the in-memory transport ------------------------------------------

def _count_looks(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    looks: dict[int, int] = {}
    real = WhereService.ask_everyone

    def counted(self: WhereService, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
        rank = self._comm.rank
        looks[rank] = looks.get(rank, 0) + 1
        return real(self, timeout)

    monkeypatch.setattr(WhereService, "ask_everyone", counted)
    return looks


def test_a_recv_cycle_is_found_by_the_prober_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_DEADLOCK_AFTER", "0.2")
    looks = _count_looks(monkeypatch)

    def ring(rank: int, n: int) -> str:
        t = np.zeros(2, np.float32)
        try:
            dist.recv(t, src=(rank + 1) % n)
        except DeadlockError as exc:  # caught, so this rank's thread does not "die"
            return str(exc)
        return "received"

    for message in run_threads(ring, 5, timeout=30.0, op_timeout=20.0):
        assert "rank 0 -> rank 1 -> rank 2 -> rank 3 -> rank 4 -> rank 0" in message, message
    assert set(looks) == {0}, looks  # nobody else asked everyone
    assert looks[0] >= 2, looks  # the two looks that agree (more if one went unanswered)


def test_one_rank_computing_costs_the_waiters_no_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the prober looks (on its wait's back-off); the other waiters only note it."""
    monkeypatch.setenv("RANKWISE_DEADLOCK_AFTER", "0.1")
    looks = _count_looks(monkeypatch)

    def late(rank: int, n: int) -> float:
        t = np.ones(2, np.float32)
        if rank == 2:
            time.sleep(1.0)  # the workload: "computing" well past ``after`` (0.1 s)
        dist.all_reduce(t)
        return float(t[0])

    assert run_threads(late, 4, timeout=30.0) == [4.0] * 4
    assert set(looks) <= {0}, looks
    assert looks.get(0, 0) <= 6, looks  # 0.1, 0.2, 0.4, 0.8 s (and a late glance or two)
