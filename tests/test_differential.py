"""Differential tests: every collective and p2p op on rankwise vs torch gloo, same inputs.

Why: rankwise claims to be torch.distributed with another engine underneath, so the
strongest check is to run the same random calls through both and compare. One process
launch per world size runs a few hundred seeded cases (see ``_differential_cases``), so
the whole file stays within about a minute on two slow cores.

Reproduce a failure with the seed printed in its message::

    RANKWISE_DIFF_SEED=<seed> pytest tests/test_differential.py -k "<world size>"

``RANKWISE_DIFF_CASES`` raises the number of cases per world size for longer hunts.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
from _differential_cases import (
    ALL_OPS,
    P2P,
    cross_group_p2p,
    differential_worker,
    gloo_ok,
    make_cases,
    torch_213_names,
)

from rankwise.testing import RankResult, free_port, run_ranks

N_CASES = int(os.environ.get("RANKWISE_DIFF_CASES", "200"))
#: SIGABRT at interpreter exit, after the rank already returned its summary: torch 2.13's
#: gloo sometimes dies in static destructors ("terminate called without an active
#: exception", no Python frame). rankwise is pure Python and cannot raise that.
_EXIT_ABORT = -6


def _seed(ws: int) -> int:
    return int(os.environ.get("RANKWISE_DIFF_SEED", str(20_240 + ws)))


def _summaries(results: list[RankResult], seed: int, ws: int) -> list[dict[str, Any]]:
    """Every rank's summary, or a failure that names the seed and every failed rank's
    error (the first rank's alone often only says that another one left)."""
    failed = [r for r in results if not (r.error_type is None and isinstance(r.value, dict)
                                         and r.exitcode in (0, _EXIT_ABORT))]
    if failed:
        first = failed[0]
        others = "".join(f"\n--- rank {r.rank} ({r.error_type}, exit {r.exitcode}): "
                         f"{r.message}" for r in failed[1:])
        pytest.fail(f"seed {seed}, world size {ws}: rank {first.rank} failed "
                    f"({first.error_type}, exit {first.exitcode}): {first.message}{others}\n"
                    f"{first.traceback}")
    return [r.value for r in results]


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5])
@pytest.mark.torch_engines
@pytest.mark.tensor_paths
@pytest.mark.procs
def test_rankwise_matches_gloo(ws: int, engine: str) -> None:
    # CI time: the wrappers over gloo (and the staging over rankwise's own engines) have
    # no algorithm of their own that a fourth or fifth rank would change; for them 2 covers
    # powers of two and 3 the rest. RANKWISE_DIFF_ALL=1 runs them all.
    if ws >= 4 and engine not in ("tcp", "shm") and os.environ.get("RANKWISE_DIFF_ALL") != "1":
        pytest.skip(f"world size {ws} runs on tcp and shm only (RANKWISE_DIFF_ALL=1: all)")
    seed = _seed(ws)
    results = run_ranks(differential_worker, ws, args=(seed, N_CASES, free_port()),
                        timeout=150)
    summaries = _summaries(results, seed, ws)

    mismatches = [m for s in summaries for m in s["mismatches"]]
    assert not mismatches, (f"seed {seed}, world size {ws}: {len(mismatches)} mismatches:\n"
                            + "\n".join(mismatches[:40]))

    # all_reduce / all_gather_into_tensor results must be the same bits on every member
    digests: dict[int, set[str]] = {}
    for s in summaries:
        for index, d in s["digests"].items():
            digests.setdefault(index, set()).add(d)
    split = sorted(i for i, ds in digests.items() if len(ds) > 1)
    assert not split, f"seed {seed}, world size {ws}: ranks got different bits in cases {split}"

    ran: Counter[str] = Counter()
    for s in summaries:
        ran.update(s["ran"])
    assert sum(s["gloo"] for s in summaries) > 0, "torch gloo was never the oracle"


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5])
def test_cases_cover_every_op(ws: int) -> None:
    """The generator (pure, same on every rank) reaches every op and both oracles."""
    cases = make_cases(_seed(ws), ws, N_CASES)
    ops = {c.op for c in cases}
    expected = set(ALL_OPS) - (P2P if ws == 1 else set())
    assert expected <= ops, f"seed {_seed(ws)}: never generated {sorted(expected - ops)}"
    assert any(gloo_ok(c) for c in cases) and not all(gloo_ok(c) for c in cases)
    assert any(c.numel >= (256 << 10) // 4 for c in cases), "no ring-regime all_reduce"
    assert any(c.ring_threshold == 0 and c.numel < 2 * ws for c in cases) or ws == 1
    assert make_cases(_seed(ws), ws, N_CASES) == cases, "case generation is not deterministic"


def _values_of_3_ranks(worker: Any) -> list[Any]:
    """Run ``worker(rank, 3, torch_port)`` on 3 ranks; their values, none having raised."""
    results = run_ranks(worker, 3, args=(free_port(),), timeout=45)
    for r in results:
        assert r.error_type is None, f"rank {r.rank}: {r.error_type}: {r.message}"
    return [r.value for r in results]


def _torch_has(name: str) -> bool:
    """Whether torch is installed and ``torch.distributed`` has ``name`` (2.13 added some)."""
    try:
        import torch.distributed as td
    except ImportError:
        return False
    return hasattr(td, name)


@pytest.mark.usefixtures("engine")
@pytest.mark.torch_engines
@pytest.mark.tensor_paths
@pytest.mark.procs
@pytest.mark.skipif(not _torch_has("all_gather_single"),
                    reason="torch 2.13's names: this torch has no all_gather_single")
def test_torch_213_collective_names() -> None:
    values = _values_of_3_ranks(torch_213_names)
    for rank, value in enumerate(values):
        assert value["rankwise"] == value["gloo"], rank
    assert values[1]["gloo"][1] == [3 * 6, 4 * 6, 5 * 6]  # (1+2+3) x rank 1's slice


@pytest.mark.usefixtures("engine")
@pytest.mark.torch_engines
@pytest.mark.tensor_paths
@pytest.mark.procs
def test_p2p_is_scoped_by_group() -> None:
    got = _values_of_3_ranks(cross_group_p2p)[2]
    assert got["gloo"] == [(1, 2.0), (1, 2.0), (1, 1.0), (0, 3.0)], got  # torch's semantics
    assert got["rankwise"] == got["gloo"]
