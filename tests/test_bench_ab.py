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


def _run(n: int, rankwise: list[float], gloo: list[float]) -> dict[str, Any]:
    cell = {"op": "all_reduce", "bytes": 4, "kernel": {},
            "seconds": {"rankwise-shm": rankwise, "gloo": gloo}}
    return {"world_size": n, "rounds": len(gloo), "passes": [{"engine": "shm", "cells": [cell]}]}


def test_ratios_pair_rankwise_with_gloo_in_each_round() -> None:
    got = bench_ab.ratios([_run(2, [1e-6, 3e-6], [4e-6, 4e-6]), _run(4, [2e-6], [1e-6])])
    assert got == {(2, "rankwise-shm", "all_reduce", 4): [0.25, 0.75],
                   (4, "rankwise-shm", "all_reduce", 4): [2.0]}


def test_table_marks_worse_only_when_the_quartiles_and_the_reps_part() -> None:
    cell = (2, "rankwise-shm", "all_reduce", 4)
    old = [{cell: [0.5, 0.6, 0.7]}, {cell: [0.5, 0.6, 0.7]}]
    inside = bench_ab.table(old, [{cell: [0.6, 0.7, 0.8]}, {cell: [0.6, 0.7, 0.8]}])[1]
    assert inside.endswith("1.17  0.60 0.60 | 0.70 0.70")
    outside = bench_ab.table(old, [{cell: [0.8, 0.9, 1.0]}, {cell: [0.8, 0.9, 1.0]}])[1]
    assert outside.endswith("1.50  0.60 0.60 | 0.90 0.90  worse")
    assert "0.60 (0.50-0.70)" in outside and "0.90 (0.80-1.00)" in outside
    # the rounds part, but one rep of each is no verdict
    single = bench_ab.table(old[:1], [{cell: [0.8, 0.9, 1.0]}])[1]
    assert "worse" not in single
