"""Unit tests of the diagnosis pieces (in-process, fast): report text, divergence rule,
cycle detection, call-site capture, barrier names, trace merge; plus one small real run
of the public helpers. The broken-program catalogue is ``test_diagnosis_catalogue.py``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from rankwise.checks.report import (
    cycle_text,
    find_cycle,
    format_where,
    mismatch_report,
    rank_list,
    stalled_mismatch,
)
from rankwise.diagnosis.trace import Tracer, merge
from rankwise.identity import callsite as _callsite
from rankwise.identity.calls import Fingerprint, barrier_name_code, describe_call
from rankwise.testing import run_ranks
from rankwise.wire.frames import Flag, Op


def test_rank_list() -> None:
    assert rank_list([0]) == "rank 0"
    assert rank_list([3, 1, 2]) == "ranks 1-3"
    assert rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([0, 2, 5, 6, 7]) == "ranks 0, 2, 5-7"


def _e(seq: int, call: str, chain: str) -> dict[str, Any]:
    return {"seq": seq, "call": call, "site": chain.split(" <- ")[0], "chain": chain,
            "done": True}


def _trap_reports() -> dict[int, dict[str, Any]]:
    """Seed 000 as histories: #1 is the legal pairing of the rank-0-first barriers from
    different lines, #3 is rank 0's extra barrier (validation loader) that paired with
    the others' end-of-epoch barrier, #4 fails."""
    zf_wait = "t.py:10 in zero_first <- t.py:20 in create_dataloader <- t.py:30 in main"
    zf_rel = "t.py:12 in zero_first <- t.py:20 in create_dataloader <- t.py:30 in main"
    zf_val = "t.py:12 in zero_first <- t.py:20 in create_dataloader <- t.py:33 in main"
    bcast = "t.py:31 in main"
    end = "t.py:40 in main"
    avg = "t.py:41 in main"
    r0 = [_e(1, "barrier()", zf_rel), _e(2, "broadcast(float32 x 8, root=0)", bcast),
          _e(3, "barrier()", zf_val), _e(4, "barrier()", end)]
    other = [_e(1, "barrier()", zf_wait), _e(2, "broadcast(float32 x 8, root=0)", bcast),
             _e(3, "barrier()", end), _e(4, "all_reduce(float32 x 8, op=SUM)", avg)]
    reports = {0: {"state": "in barrier", "history": {"0": r0}, "groups": {"0": "WORLD"}}}
    for r in (1, 2, 3):
        reports[r] = {"state": "in all_reduce", "history": {"0": other},
                      "groups": {"0": "WORLD"}}
    return reports


def test_divergence_skips_the_legal_pairing_and_names_the_extra_barrier() -> None:
    text = mismatch_report(_trap_reports(), 0, 4, 0, 1)
    assert ("Where the ranks diverged: collective #3 of WORLD: rank 0 reached barrier() at "
            "t.py:12 in zero_first <- t.py:20 in create_dataloader <- t.py:33 in main; "
            "while ranks 1-3 reached barrier() at t.py:40 in main.") in text
    assert "Collective #3 still completed" in text
    assert "#1" in text and "<- diverged" in text and "<- failed" in text


def test_divergence_at_the_failing_call_when_stacks_agree_before() -> None:
    same = "u.py:5 in step"
    reports = {
        r: {"state": "x", "history": {"0": [_e(1, "all_reduce(float32 x 4, op=SUM)", same),
                                            _e(2, f"all_reduce(float32 x {4 + r}, op=SUM)",
                                               same)]}}
        for r in (0, 1)
    }
    text = mismatch_report(reports, 0, 2, 0, 1)
    assert "Where the ranks diverged: collective #2 of group 0" in text
    assert "Up to #1 every rank made the same calls" in text


def test_no_history_is_said_plainly() -> None:
    text = mismatch_report({0: {"state": "a"}, 1: {"state": "b"}}, 0, 3, 0, 1)
    assert "divergence point is unknown" in text


def test_cycle_detection() -> None:
    reports = {
        0: {"op": "recv", "kind": "recv", "waiting_for": 1, "site": "p.py:3 in f"},
        1: {"op": "recv", "kind": "recv", "waiting_for": 2, "site": "p.py:4 in f"},
        2: {"op": "recv", "kind": "recv", "waiting_for": 0, "site": "p.py:5 in f"},
        3: {"op": "", "waiting_for": -1},
    }
    assert find_cycle(reports) == [0, 1, 2]
    text = cycle_text(reports)
    assert text.startswith("DEADLOCK: rank 0 waits for rank 1 (recv at p.py:3 in f), which "
                           "waits for rank 2 (recv at p.py:4 in f), which waits for rank 0")
    assert "irecv" in text
    reports[2] = {"op": "", "waiting_for": -1, "state": "running user code"}
    assert find_cycle(reports) == [] and cycle_text(reports) == ""
    assert "DEADLOCK" not in format_where(reports, "test")


def test_ranks_inside_one_collective_are_no_deadlock() -> None:
    # a snapshot taken mid all_reduce: the ranks wait for each other while data moves
    def coll(seq: int, waits: int) -> dict[str, object]:
        return {"op": "all_reduce", "kind": "collective", "group": 0, "seq": seq,
                "waiting_for": waits, "site": "t.py:9 in step"}

    reports = {0: coll(7, 1), 1: coll(7, 0), 2: {"op": "", "waiting_for": -1}}
    assert find_cycle(reports) == [] and "DEADLOCK" not in format_where(reports, "test")
    reports[1] = coll(8, 0)  # different calls: neither can finish the other's
    assert find_cycle(reports) == [0, 1]


def test_stalled_mismatch_needs_same_seq_and_different_calls() -> None:
    a = {"op": "gather", "kind": "collective", "group": 0, "seq": 4,
         "call": "gather(float32 x 2, root=0)"}
    b = dict(a, call="gather(float32 x 2, root=1)")
    assert stalled_mismatch({0: a, 1: b}) == (0, 4, {"gather(float32 x 2, root=0)": [0],
                                                     "gather(float32 x 2, root=1)": [1]})
    assert stalled_mismatch({0: a, 1: dict(a)}) is None  # same call: just slow
    assert stalled_mismatch({0: a, 1: dict(b, seq=5)}) is None  # different calls in flight
    assert stalled_mismatch({0: a, 1: dict(b, kind="recv")}) is None


def test_named_barrier_descriptions() -> None:
    code = barrier_name_code("checkpoint")
    assert code > 0xFFFFFFFF  # never 0 (unnamed) nor -1 (any count)
    assert describe_call(Op.barrier, 0, code, 0, 0, None) == "barrier(name='checkpoint')"
    assert describe_call(Op.barrier, 0, 0, 0, 0, None) == "barrier()"
    unknown = (1 << 32) | 0x1234
    assert describe_call(Op.barrier, 0, unknown, 0, 0, None) == "barrier(name=#00001234)"
    rzf = barrier_name_code("rank_zero_first@data.py:40")
    assert describe_call(Op.barrier, 0, rzf, 0, 0, None, flags=Flag.SYNC) == \
        "rank_zero_first(block at data.py:40)"


@contextmanager
def _ctx() -> Iterator[Any]:
    yield _callsite.capture()  # @ctx-yield


def _outer() -> Any:
    with _ctx() as site:  # @ctx-with
        return site


def test_capture_skips_contextlib_and_keeps_callers() -> None:
    sites = []
    for _ in range(2):
        sites.append(_outer())
    site, again = sites
    names = [fn for _, _, fn in site.frames]
    assert names[:3] == ["_ctx", "_outer", "test_capture_skips_contextlib_and_keeps_callers"]
    assert all(not f.endswith("contextlib.py") for f, _, _ in site.frames)
    assert len(site.frames) <= 4
    assert again is site  # cached per (code, line) chain


def _site_here() -> Any:
    return _callsite.capture()


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(marker))


def test_capture_lines_exact_with_offset_keys() -> None:
    """The cache is keyed by instruction offsets: each site still names its own line,
    and one callee line reached from two caller lines gives two sites."""
    a = _site_here()  # @site-a
    b = _site_here()  # @site-b
    pair = [_site_here() for _ in range(2)]  # @site-loop
    assert a.frames[1][1] == _line_of("# @site-a")
    assert b.frames[1][1] == _line_of("# @site-b")
    assert a.id != b.id and a.frames[0] == b.frames[0]  # same callee line, other callers
    assert pair[0] is pair[1] and pair[0].frames[1][1] == _line_of("# @site-loop")


def test_capture_can_be_switched_off() -> None:
    try:
        _callsite.set_enabled(False)
        assert _callsite.capture() is _callsite.UNKNOWN
        assert not _callsite.enabled()
    finally:
        _callsite.set_enabled(True)
    assert _callsite.capture().frames


def test_trace_merge(tmp_path: Any) -> None:
    class Rec:
        seq, started, finished = 1, 100.0, 100.5

        fp = Fingerprint(int(Op.barrier), 0, 0, 0, 0, 0)

        site = _callsite.UNKNOWN
        label = None  # as a Call outside record_comm

    class Grp:
        name, ranks = "WORLD", [0, 1]

    for rank in (0, 1):
        t = Tracer(str(tmp_path), rank)
        t.collective(Grp, Rec)
        t.recv(101.0, 101.25, 1 - rank, 16, 0, _callsite.UNKNOWN)
        t.write()
    out = os.path.join(str(tmp_path), "all.json")
    assert merge(str(tmp_path), out) == 4
    with open(out) as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    assert {e["pid"] for e in spans} == {0, 1}
    assert spans[0]["dur"] == pytest.approx(0.5e6)


# --- one real run of the public helpers ------------------------------------------------------

def _helpers(rank: int, world: int) -> dict[str, Any]:
    import numpy as np

    import rankwise as dist

    with dist.rank_zero_first():
        pass
    with dist.main_process_first(local=True):
        pass
    dist.barrier(name="same-everywhere")
    dist.monitored_barrier(timeout=5, wait_all_ranks=True)
    t = np.ones(2, np.float32)
    dist.all_reduce(t)
    table = dist.who_is_where()
    return {"table": table, "sum": float(t[0])}


@pytest.mark.procs
def test_helpers_on_a_correct_program() -> None:
    results = run_ranks(_helpers, 3, timeout=60, init_kwargs={"timeout": 10.0})
    for res in results:
        assert res.ok, res.traceback
        assert res.value["sum"] == 3.0
        table = res.value["table"]
        assert table.startswith(f"who is where (asked by rank {res.rank}):")
        for r in range(3):
            assert f"  rank {r}: " in table
        assert "DEADLOCK" not in table
