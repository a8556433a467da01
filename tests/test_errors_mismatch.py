"""Fingerprint mismatches (issue 2, item 8): ranks calling different collectives, shapes,
dtypes, roots or reduce ops get ``CollectiveMismatch`` on every rank, naming both calls
(op names and the file:line of both call sites) — never a hang, never wrong data.

Rooted calls end with an agreement (``algorithms/agree.py``), so even a rank whose share
is only sending raises from the mismatched call itself (``test_root_agreement.py``);
the barrier after each call stays as a net for other ops. One rank (``odd``) makes a different call from the others; each call below carries a
``# CALL:<name>`` marker so the test can compute the line numbers the message must name.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from _error_cases import assert_every_rank, line_of

import rankwise as dist
from rankwise.testing import run_ranks

#: every test here runs once per engine (tcp, shm): see conftest.engine
pytestmark = [pytest.mark.procs, pytest.mark.usefixtures("engine"), pytest.mark.torch_engines]

ME = os.path.basename(__file__)


def _mismatch(rank: int, world: int, case: str, odd: int) -> Any:
    a = np.arange(4, dtype=np.float32) + rank
    if case == "op":
        if rank == odd:
            dist.all_reduce(a)  # CALL:op-odd
        else:
            dist.broadcast(a, src=0)  # CALL:op-rest
    elif case == "count":
        if rank == odd:
            dist.all_reduce(np.ones(5, np.float32))  # CALL:count-odd
        else:
            dist.all_reduce(a)  # CALL:count-rest
    elif case == "dtype":
        if rank == odd:
            dist.all_reduce(a.astype(np.float64))  # CALL:dtype-odd
        else:
            dist.all_reduce(a)  # CALL:dtype-rest
    elif case == "root":
        if rank == odd:
            dist.broadcast(a, src=1)  # CALL:root-odd
        else:
            dist.broadcast(a, src=0)  # CALL:root-rest
    elif case == "reduce_op":
        if rank == odd:
            dist.all_reduce(a, op=dist.ReduceOp.MAX)  # CALL:reduce_op-odd
        else:
            dist.all_reduce(a, op=dist.ReduceOp.SUM)  # CALL:reduce_op-rest
    elif case == "barrier":
        if rank == odd:
            dist.all_reduce(a)  # CALL:barrier-odd
        else:
            dist.barrier()  # CALL:barrier-rest
            dist.all_reduce(a)
    elif case == "splits":
        if rank == odd:  # sends 2 rows to (and expects 2 from) the next rank, which says 1
            rows = np.zeros((world + 1, 2), np.float32)
            split = [2 if r == (odd + 1) % world else 1 for r in range(world)]
            time.sleep(0.3)  # the others' frames arrive (and are parked) before this call
            dist.all_to_all_single(rows, rows + 1, split, split)  # CALL:splits-odd
        else:
            rows = np.zeros((world, 2), np.float32)
            dist.all_to_all_single(rows, rows + 1)  # CALL:splits-rest
    else:
        raise AssertionError(case)
    # A rank whose part of the mismatched call was only sending (a broadcast root) may
    # return from it before a peer detects the mismatch; it must then fail at its next call.
    done = a.tolist()
    dist.barrier()
    return done  # reaching here means a mismatch went unnoticed


# (case, op name of the odd rank's call, op name of the others', extra needles)
CASES = [
    ("op", "all_reduce", "broadcast", ()),
    ("count", "all_reduce", "all_reduce", ("x 5", "x 4")),
    ("dtype", "all_reduce", "all_reduce", ("float64", "float32")),
    ("root", "broadcast", "broadcast", ("root=1", "root=0")),
    ("reduce_op", "all_reduce", "all_reduce", ("op=MAX", "op=SUM")),
    ("barrier", "all_reduce", "barrier", ()),
    ("splits", "all_to_all_single", "all_to_all_single", ("bytes",)),
]


def _params() -> list[Any]:
    out = []
    for case, odd_op, rest_op, needles in CASES:
        for world, odd in ((2, 0), (4, 3)):
            timeout = 10.0
            if case == "root" and world == 2:
                # both ranks name the other as root: both wait to receive and no frame crosses;
                # only the hang-time check can find it, so keep the group timeout short
                timeout = 3.0
            out.append(pytest.param(case, odd_op, rest_op, needles, world, odd, timeout,
                                    id=f"{case}-{world}ranks"))
    return out


@pytest.mark.parametrize("case,odd_op,rest_op,needles,world,odd,timeout", _params())
def test_mismatch_raises_on_every_rank_naming_both_calls(
        case: str, odd_op: str, rest_op: str, needles: tuple[str, ...], world: int, odd: int,
        timeout: float) -> None:
    results = run_ranks(_mismatch, world, args=(case, odd), timeout=120,
                        init_kwargs={"timeout": timeout})
    odd_line = line_of(__file__, f"# CALL:{case}-odd")
    rest_line = line_of(__file__, f"# CALL:{case}-rest")
    assert_every_rank(results, "CollectiveMismatch", odd_op, rest_op,
                      f"{ME}:{odd_line}", f"{ME}:{rest_line}", *needles, within=5.0)
    for r in results:
        assert "collective #1" in r.message, r.message
