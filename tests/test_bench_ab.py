"""benchmarks/bench_ab.py's comparison, on saved-run shapes (no processes): each cell's
rankwise/gloo ratio per rep, old beside new, and ``worse`` only outside the reps' range."""

from __future__ import annotations

import importlib.util
from typing import Any

from _procs import ROOT

# loaded by path: benchmarks/ on sys.path would let its scripts shadow other modules
_spec = importlib.util.spec_from_file_location("bench_ab", ROOT / "benchmarks" / "bench_ab.py")
assert _spec is not None and _spec.loader is not None
bench_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_ab)


def _run(n: int, rankwise: float, gloo: float) -> dict[str, Any]:
    cell = {"op": "all_reduce", "bytes": 4, "kernel": {},
            "seconds": {"rankwise-shm": [rankwise] * 3, "gloo": [gloo] * 3}}
    return {"world_size": n, "rounds": 3, "passes": [{"engine": "shm", "cells": [cell]}]}


def test_ratios_are_rankwise_over_gloo_per_cell() -> None:
    got = bench_ab.ratios([_run(2, 1e-6, 4e-6), _run(4, 3e-6, 4e-6)], ROOT / "src")
    assert got == {(2, "rankwise-shm", "all_reduce", 4): 0.25,
                   (4, "rankwise-shm", "all_reduce", 4): 0.75}


def test_table_marks_worse_only_outside_the_reps_range() -> None:
    cell = (2, "rankwise-shm", "all_reduce", 4)
    old = [{cell: 0.5}, {cell: 0.6}]
    inside = bench_ab.table(old, [{cell: 0.55}, {cell: 0.65}])[1]
    assert inside.split()[-1] == "1.09" and "worse" not in inside
    outside = bench_ab.table(old, [{cell: 0.7}, {cell: 0.8}])[1]
    assert outside.endswith("1.36  worse")
    assert "0.55 (0.50-0.60)" in outside and "0.75 (0.70-0.80)" in outside
