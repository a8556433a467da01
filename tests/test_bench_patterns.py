"""``rankwise bench --pattern``: the options checked before any process starts, and the
pattern functions run in-process (fake calls, no sockets)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _procs
import pytest

from rankwise.bench import run as bench
from rankwise.bench.patterns import Pattern, busy, skew_draws, timed_batch
from rankwise.bench.report import format_tables
from rankwise.bench.worker import WorkerConfig


def _cfg(argv: list[str]) -> WorkerConfig:
    p = bench._parser()
    return bench._check(p, p.parse_args(argv), worker=True)


def test_default_pattern_is_lockstep() -> None:
    assert _cfg([]).pattern == Pattern("lockstep", 0.0)


def test_skew_defaults_and_travels_to_the_workers() -> None:
    assert _cfg(["--pattern", "skewed"]).pattern == Pattern("skewed", 100.0)
    cfg = _cfg(["--pattern", "skewed", "--skew", "1000"])
    assert cfg.pattern == Pattern("skewed", 1000.0)
    assert _cfg(bench._worker_argv(cfg, "raw.json")).pattern == cfg.pattern
    for name in ("interleaved", "stopflag"):
        side = _cfg(["--pattern", name])
        assert _cfg(bench._worker_argv(side, "raw.json")).pattern == side.pattern


@pytest.mark.parametrize("argv, says", [
    (["--pattern", "bursty"], "invalid choice: 'bursty'"),
    (["--skew", "10"], "--skew only applies to --pattern skewed"),
    (["--pattern", "skewed", "--skew", "-1"], "--skew: -1 us is outside"),
    (["--pattern", "interleaved", "--no-gloo"], "needs torch and gloo"),
    (["--pattern", "stopflag", "--no-gloo"], "--pattern stopflag calls gloo"),
])
def test_pattern_misuse_stops_before_any_process(argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _cfg(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_skew_draws_are_per_rank_repeatable_and_in_range() -> None:
    a = skew_draws(0, 200, 100.0)
    assert a == skew_draws(0, 200, 100.0)  # every library of a cell gets the same draws
    assert a != skew_draws(1, 200, 100.0)  # ranks arrive apart
    assert all(0.0 <= x <= 100e-6 for x in a) and max(a) > 50e-6
    assert skew_draws(3, 5, 0.0) == [0.0] * 5


def test_busy_holds_the_cpu_for_the_time_asked() -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    busy(0.02)
    assert time.perf_counter() - t0 >= 0.02
    assert time.process_time() - c0 > 0.0  # computed, not slept


def _counting(log: list[str], name: str, seconds: float = 0.0) -> Callable[[], None]:
    def call() -> None:
        log.append(name)
        if seconds:
            busy(seconds)
    return call


@pytest.mark.parametrize("name", ["interleaved", "stopflag"])
def test_a_side_pattern_runs_a_side_call_after_each_call_and_times_only_the_call(
        name: str) -> None:
    log: list[str] = []
    t = timed_batch(Pattern(name), 0, 3, _counting(log, "call"),
                    _counting(log, "side", 0.01))
    assert log == ["call", "side"] * 3
    assert t.mean < 0.005 and t.median < 0.005  # the side call's 10 ms is not counted


def test_skewed_computes_before_each_call_and_times_only_the_call() -> None:
    log: list[str] = []
    t = timed_batch(Pattern("skewed", 5000.0), 2, 4, _counting(log, "call"))
    assert log == ["call"] * 4
    assert t.mean < 0.002  # the up to 5 ms of compute before each call is not counted


def test_lockstep_times_the_batch_and_needs_no_side_call() -> None:
    log: list[str] = []
    t = timed_batch(Pattern(), 0, 5, _counting(log, "call", 0.002))
    assert log == ["call"] * 5
    assert t.mean >= 0.002 and t.median == t.mean


def test_bad_pattern_use_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a side call"):
        timed_batch(Pattern("interleaved"), 0, 1, lambda: None)
    with pytest.raises(ValueError, match="the stopflag pattern needs a side call"):
        timed_batch(Pattern("stopflag"), 0, 1, lambda: None)
    with pytest.raises(ValueError, match="unknown pattern 'x'"):
        timed_batch(Pattern("x"), 0, 1, lambda: None)


def test_report_names_the_pattern_and_gives_mean_and_median_ratios() -> None:
    cell = {"op": "all_reduce", "bytes": 4, "kernel": {},
            "seconds": {"rankwise-shm": [2e-6, 4e-6], "gloo": [10e-6, 10e-6]},
            "median_seconds": {"rankwise-shm": [1e-6, 1e-6], "gloo": [10e-6, 10e-6]}}
    run = {"world_size": 2, "rounds": 2, "pattern": "skewed", "skew_us": 100.0,
           "passes": [{"engine": "shm", "cells": [cell]}]}
    text = "\n".join(format_tables([run]))
    assert "pattern skewed: a random busy compute of 0..100 us" in text
    row = next(x for x in text.splitlines() if x.startswith("all_reduce"))
    assert "0.30 (0.20-0.40)" in row  # mean: 3 us / 10 us, rounds 0.2 and 0.4
    assert "0.10 (0.10-0.10)" in row  # median per call: 1 us / 10 us
    lockstep = "\n".join(format_tables([{**run, "pattern": "lockstep"}]))
    assert "p50" not in lockstep
    flag = "\n".join(format_tables([{**run, "pattern": "stopflag"}]))
    assert "pattern stopflag: each call followed by a one-element gloo all_reduce (MAX)" in flag


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.procs
@pytest.mark.parametrize("name", ["interleaved", "stopflag"])
def test_side_pattern_real_run(tmp_path: Path, name: str) -> None:
    """The one part only real ranks reach: the second gloo group of the side calls."""
    pytest.importorskip("torch")
    raw = tmp_path / "raw.json"
    argv = ["-n", "2", "--engines", "shm", "--sizes", "4", "--rounds", "1", "--iters", "3",
            "--no-mpi", "--pattern", name, "--json", str(raw)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")}
    res = _procs.run([sys.executable, "-m", "rankwise", "bench", *argv], env=env, timeout=120,
                     cwd=None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"pattern {name}" in res.stdout
    (run,) = json.loads(raw.read_text())["runs"]
    assert run["pattern"] == name
    (cell,) = run["passes"][0]["cells"]
    assert cell["iters"] == {"rankwise-shm": 3, "gloo": 3}
    assert all(len(v) == 1 and v[0] > 0 for v in cell["median_seconds"].values())
