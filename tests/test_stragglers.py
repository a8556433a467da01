"""Straggler attribution (``checks.stragglers``): the verdict from fake windows, the stack
look on a real thread, and ``rankwise.stragglers()`` over thread-ranks."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

import rankwise
from rankwise.checks.stragglers import MIN_CALLS, Straggler, StragglerBook, attribute
from rankwise.testing.threads import run_threads


class _Comm(SimpleNamespace):
    """A communicator's fields the book reads (weakly referable, as the real one)."""


SLEEP_LINE = "data.py:14 in __getitem__ (calling time.sleep)"


def _book(rank: int, waits: list[float], gaps: list[float] | None = None,
          lines: list[tuple[str, int]] | None = None, ranks: int = 4,
          key: Any = None) -> dict[str, Any]:
    gaps = gaps or [10.0] * len(waits)
    rows = [[seq + 1, w, g, key(seq) if key else "1:4:7"]
            for seq, (w, g) in enumerate(zip(waits, gaps))]
    lines = lines or []
    return {"rank": rank, "groups": {"0": {"name": "pg0", "ranks": list(range(ranks)),
                                           "calls": rows}},
            "lines": lines, "samples": sum(n for _, n in lines)}


def _skewed(n: int = 40, slow: int = 2, ms: float = 30.0) -> list[dict[str, Any]]:
    rng = random.Random(1)
    out = []
    for r in range(4):
        waits = [rng.uniform(0, 1) + (0 if r == slow else ms) for _ in range(n)]
        lines = [("train.py:30 in main", 20)]
        if r == slow:
            lines.append((SLEEP_LINE, 60))
        out.append(_book(r, waits, lines=lines))
    return out


def test_the_rank_that_waits_least_is_named_with_its_line() -> None:
    found = attribute(_skewed())
    assert len(found) == 1
    s = found[0]
    assert (s.rank, s.group, s.line) == (2, "pg0", SLEEP_LINE)
    assert 28 < s.per_call_ms < 32 and 28 < s.per_step_ms < 32
    assert 0.6 < s.share < 0.8  # 30 ms of the others' ~40 ms a call
    assert str(s).startswith("rank 2 holds the others back")


def test_steps_of_several_calls_sum_their_waits() -> None:
    # two buckets a step, the straggler's delay lands on the first one only
    books = []
    for r in range(4):
        waits = [(0.2 if r == 1 else 20.0) if seq % 2 == 0 else 0.3 for seq in range(40)]
        books.append(_book(r, waits, key=lambda seq: f"1:{seq % 2}:7"))
    found = attribute(books)
    # rank 1 arrives last at every step's first call only: half the calls, not named
    assert found == []
    for r in range(4):
        if r != 1:  # the other calls are a tie broken by order: make rank 1 least there too
            books[r]["groups"]["0"]["calls"] = [
                [row[0], row[1] + 0.1, *row[2:]] for row in books[r]["groups"]["0"]["calls"]]
    (s,) = attribute(books)
    assert s.rank == 1 and s.steps == 20 and 19 < s.per_step_ms < 21


@pytest.mark.parametrize("seed", range(20))
def test_balanced_ranks_under_random_delays_name_nobody(seed: int) -> None:
    rng = random.Random(seed)
    # a loaded machine: each rank late by 0-20 ms at random, each call
    books = [_book(r, [rng.expovariate(1 / 8) for _ in range(64)]) for r in range(4)]
    assert attribute(books) == []


def test_a_small_steady_skew_is_not_a_straggler() -> None:
    books = [_book(r, [1.0 if r == 0 else 3.0] * 64, gaps=[40.0] * 64) for r in range(4)]
    assert attribute(books) == []  # 2 ms a step: under MIN_MS


def test_too_few_calls_or_a_missing_member_name_nobody() -> None:
    assert attribute([b for b in _skewed(n=MIN_CALLS - 1)]) == []
    assert attribute(_skewed()[:3]) == []  # rank 3 did not report
    assert attribute([None, *_skewed()[1:]]) == []


def test_a_line_every_rank_runs_as_long_cancels_out() -> None:
    books = _skewed()
    for b in books:  # everyone spends most looks in the forward pass
        b["lines"] = [("model.py:5 in forward", 90)] + ([(SLEEP_LINE, 30)] if b["rank"] == 2
                                                        else [])
        b["samples"] = sum(n for _, n in b["lines"])
    assert attribute(books)[0].line == SLEEP_LINE


def _parked(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait(10)  # the line a look must name


def test_a_look_names_the_user_line_only_between_calls() -> None:
    ready, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_parked, args=(ready, release), daemon=True)
    t.start()
    assert ready.wait(5)
    idle = object()
    comm = _Comm(doing=idle, calls=SimpleNamespace(idle=idle), user_thread=t.ident,
                           closed=False, rank=3, groups={})
    book = StragglerBook(comm, start=False)
    try:
        book.sample(comm)
        comm.doing = object()  # in a call: waiting is not what it runs
        book.sample(comm)
    finally:
        release.set()
        t.join(5)
    local = book.local()
    assert local["samples"] == 1 and local["rank"] == 3
    (line, n), = local["lines"]
    assert line.startswith("test_stragglers.py:") and "in _parked" in line and n == 1
    assert "release.wait" in line


def _fake_call(seq: int, started: float, finished: float) -> Any:
    return SimpleNamespace(seq=seq, started=started, finished=finished,
                           fp=SimpleNamespace(op=1, count=4), site=SimpleNamespace(id=9))


def test_local_reads_waits_and_gaps_from_the_history_and_keeps_them() -> None:
    calls = [_fake_call(1, 10.0, 10.03), _fake_call(2, 10.05, 10.06),
             _fake_call(3, 10.07, 0.0)]  # the last one in flight
    group = SimpleNamespace(id=0, name="pg0", ranks=[0, 1], recent=lambda n: calls)
    comm = _Comm(rank=0, groups={0: group}, closed=False)
    book = StragglerBook(comm, start=False)
    rows = book.local()["groups"]["0"]["calls"]
    assert [r[0] for r in rows] == [1, 2]
    assert rows[0][1] == pytest.approx(30.0) and rows[1][2] == pytest.approx(20.0)
    comm.groups = {}  # destroyed: the last window stays for the job's summary
    assert book.local()["groups"]["0"]["calls"] == rows


def test_stragglers_over_thread_ranks_names_the_late_one() -> None:
    def rank_fn(rank: int, n: int) -> list[Straggler]:
        import numpy as np
        x = np.ones(4, np.float32)
        for _ in range(24):
            if rank == 1:
                time.sleep(0.03)  # the workload under test, not synchronization
            rankwise.all_reduce(x)
        found: list[Straggler] = rankwise.stragglers()
        return found

    results = run_threads(rank_fn, 3, timeout=60)
    for found in results:
        assert [s.rank for s in found] == [1], found
        assert found[0].per_step_ms > 15
    assert results[0] == results[2]


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_STRAGGLERS", "0")
    comm = _Comm(rank=0, groups={}, closed=False)
    assert not StragglerBook(comm).on


def _write_dumps(directory: Any, books: list[dict[str, Any]]) -> None:
    import json

    for book in books:  # a dump file's fields that analyze reads, and the book
        record = {"rank": book["rank"], "world_size": 4, "written": 1.0, "events": [],
                  "report": None, "view": {}, "stragglers": book}
        (directory / f"rank{book['rank']}.json").write_text(json.dumps(record))


def test_analyze_names_the_straggler_from_the_dumps(tmp_path: Any) -> None:
    from rankwise.diagnosis.analyze import analyze

    _write_dumps(tmp_path, _skewed())
    text = analyze(str(tmp_path))
    assert "  straggler: rank 2 holds the others back" in text and SLEEP_LINE in text, text
    balanced = _skewed()
    for book in balanced:  # the same waits everywhere
        book["groups"]["0"]["calls"] = [[r[0], 5.0, *r[2:]] for r in book["groups"]["0"]["calls"]]
    _write_dumps(tmp_path, balanced)
    assert "  nobody: the ranks arrived together" in analyze(str(tmp_path))


def test_the_page_names_the_late_rank_and_shows_each_wait() -> None:
    import numpy as np

    from rankwise.api.world import current
    from rankwise.launch.summary import straggler_lines
    from rankwise.live.collector import Collector
    from rankwise.live.publisher import LivePublisher
    from rankwise.store.hash import HashStore

    store = HashStore()

    def rank_fn(rank: int, n: int) -> None:
        x = np.ones(4, np.float32)
        for _ in range(20):
            if rank == 0:
                time.sleep(0.03)  # the workload under test, not synchronization
            rankwise.all_reduce(x)
        LivePublisher(current().comm, store, 0).publish()

    run_threads(rank_fn, 2, timeout=60)
    collector = Collector(store)
    collector.poll()
    data = collector.data()
    assert [s["rank"] for s in data["stragglers"]] == [0], data["stragglers"]
    waits = {r["rank"]: r["wait_ms"] for r in data["ranks"]}
    assert waits[0] < waits[1] and waits[1] > 15, waits
    (line,) = straggler_lines(data)
    assert line.startswith("straggler: rank 0 holds the others back"), line
    assert straggler_lines({"stragglers": []}) == []
