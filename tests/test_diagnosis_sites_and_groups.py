"""Diagnosis, second round (issue 15): where a busy rank is, groups created out of order,
shapes in messages, call sites inside frameworks. Real processes, once per engine.

The runner and checks are the catalogue's (``test_diagnosis_catalogue.run/check``).
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_diagnosis_catalogue import check, run
from test_diagnosis_programs import line_of

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120), pytest.mark.usefixtures("engine")]

PROGRAMS = os.path.join(HERE, "_diagnosis_sites_and_groups_programs.py")
Q = "_diagnosis_sites_and_groups_programs.py"


def at(marker: str) -> str:
    return f"{Q}:{line_of(marker, PROGRAMS)}"


def test_busy_rank_says_where_its_user_code_is() -> None:
    ranks = run(PROGRAMS, "busy_sleep", warn=1.0, timeout=60.0, bound=60.0)
    for res in ranks:
        assert res.rc == 0, res.err[-3000:]
    busy = (f"rank 1: running user code at {at('sleep')} in load_data <- "
            f"{at('load-call')} in busy_sleep")
    table = ranks[0].out
    # rankwise.who_is_where(): the sleeping rank's line, its caller, what it is calling
    assert busy in table, table
    assert "(time.sleep), " in table.split("rank 1: ", 1)[1], table
    # the asking rank itself is "in user code" too: at its who_is_where() line
    assert f"rank 0: running user code at {at('ask')} in busy_sleep" in table, table
    assert "(dist.who_is_where), " in table, table
    # the slow-wait table rank 0 logs from its barrier says the same
    log = ranks[0].err
    assert "slow wait on rank 0" in log, log
    assert f"at {at('busy-barrier')} in busy_sleep" in log, log
    assert busy in log and "(time.sleep)" in log, log


def test_groups_created_out_of_order_fail_at_new_group() -> None:
    ranks = run(PROGRAMS, "group_order", n=4, timeout=20.0, bound=60.0)
    check(ranks, "CollectiveMismatch", "new_group order mismatch at group creation #1",
          f"ranks 0, 2 created new_group([0, 1]) at {at('order-a')} in group_order",
          f"ranks 1, 3 created new_group([2, 3]) at {at('order-b')} in group_order",
          "same order", within=15.0)
    for res in ranks:  # at new_group, not 20 s later in the all_reduce
        assert "DEADLOCK" not in res.err and "all_reduce" not in res.message, res.err


def test_groups_created_in_one_order_work() -> None:
    ranks = run(PROGRAMS, "group_order", n=4, timeout=20.0, bound=60.0,
                env={"ORDER": "same"})
    for res in ranks:
        assert res.rc == 0, res.err[-3000:]
        assert "OK" in res.out


def test_messages_show_shapes_and_compare_counts() -> None:
    ranks = run(PROGRAMS, "shapes", timeout=20.0, warn=5.0, bound=60.0)
    # #1 (float32[2, 2] against float32 x 4) paired: only #2 fails, with both shapes,
    # the peer's included (frames carry counts: the shape comes from its report)
    check(ranks, "CollectiveMismatch", "collective #2",
          f"all_reduce(float32[2, 2], op=SUM) at {at('shape-mismatch')}",
          f"all_reduce(float32[1, 5], op=SUM) at {at('shape-mismatch')}",
          "Where the ranks diverged: collective #2",
          # #1's shapes differ, its counts agree: the row shows what was compared
          f"#1    all ranks: all_reduce(float32 x 4, op=SUM) at {at('same-count')}",
          within=15.0)
    for res in ranks:
        assert "collective #1 " not in res.message, res.message


def test_ddp_gradient_all_reduce_is_reported_at_the_backward_line() -> None:
    pytest.importorskip("torch")
    ranks = run(PROGRAMS, "ddp_site", timeout=20.0, bound=90.0)
    check(ranks, "CollectiveMismatch",
          f"all_reduce(float32 x 20, op=SUM) at {at('ddp-backward')} in ddp_site",
          f"all_reduce(float32 x 3, op=SUM) at {at('ddp-other')} in ddp_site", within=40.0)
    for res in ranks:
        # torch's frames stay in the chain, after the user's line, never first
        assert f"{at('ddp-backward')} in ddp_site <- " in res.message, res.message
        assert "(via " in res.message and "_engine_run_backward)" in res.message, res.message
        assert "at graph.py" not in res.message, res.message
