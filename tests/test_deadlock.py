"""Deadlock detection (issue 15): when every live rank is blocked in a rankwise call and
none can proceed, every rank raises ``DeadlockError`` within seconds of the last one
blocking — with the default 30 s warning timer left in place — naming each rank's call,
group and file:line. Correct programs that are merely slow stay silent.

Real processes per rank, once per engine (tcp, shm): see conftest.engine. The programs
are in ``_deadlock_programs.py``; ``run``/``check`` come from the diagnosis catalogue.
"""

from __future__ import annotations

import os
import re
import sys

import _procs
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_diagnosis_catalogue import Rank, check, run
from test_diagnosis_programs import line_of

PROGRAMS = os.path.join(HERE, "_deadlock_programs.py")
P = "_deadlock_programs.py"
BOUND = 5.0  #: seconds from the last rank blocking to every rank raising (the issue's)

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120), pytest.mark.usefixtures("engine")]


def _stamp(res: Rank, word: str) -> float:
    m = re.search(rf"^{word} (\d+\.\d+)$", res.out, re.MULTILINE)
    assert m, f"rank {res.rank} printed no {word} line:\n{res.out}\n{res.err[-2000:]}"
    return float(m.group(1))


def _within_bound(ranks: list[Rank]) -> None:
    last_blocked = max(_stamp(r, "BLOCKING") for r in ranks)
    for res in ranks:
        took = _stamp(res, "RAISED") - last_blocked
        assert took < BOUND, f"rank {res.rank} raised {took:.1f}s after the last rank blocked"


def deadlocked(name: str, n: int, **kw: object) -> list[Rank]:
    # a timeout far above the bound: only the detector can end these runs in time
    return run(PROGRAMS, name, n=n, timeout=60.0, warn=30.0, bound=60.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("late", ["0", "3"])
def test_barrier_of_a_subgroup_against_all_reduce_of_world(late: str) -> None:
    ranks = deadlocked("cross_group", 4, env={"LATE": late})
    check(ranks, "DeadlockError", "deadlock: all 4 live ranks are blocked",
          f"ranks 0-2: barrier() #1 of group [0, 1, 2, 3] at {P}:{line_of('cross-barrier', PROGRAMS)}"
          " in cross_group", "waiting for rank 3, which has not reached it",
          f"rank 3: all_reduce(float32 x 4, op=SUM) #2 of the default group (WORLD) [ranks 0-3] at "
          f"{P}:{line_of('cross-all-reduce', PROGRAMS)} in cross_group",
          "waiting for ranks 0-2, which have not reached it", "Wait-for cycle: rank 0 -> rank 3")
    _within_bound(ranks)
    for res in ranks:
        assert "slow wait" not in res.err, res.err  # the warning timer played no part


def test_cycle_of_blocking_recvs() -> None:
    ranks = deadlocked("recv_cycle", 3)
    line = f"{P}:{line_of('ring-recv', PROGRAMS)}"
    check(ranks, "DeadlockError", f"rank 0: recv from rank 1 at {line}",
          f"rank 2: recv from rank 0 at {line}", "which is not sending",
          "Wait-for cycle: rank 0 -> rank 1 -> rank 2 -> rank 0.", "irecv")
    _within_bound(ranks)


@pytest.mark.parametrize("name", ["busy_peer_ok", "irecv_ok"])
def test_slow_but_correct_programs_stay_silent(name: str) -> None:
    ranks = run(PROGRAMS, name, n=3, timeout=60.0, warn=30.0, bound=60.0,
                env={"RANKWISE_DEADLOCK_AFTER": "0.2"})
    for res in ranks:
        assert res.rc == 0, res.err[-3000:]
        assert res.err.strip() == "", res.err[-3000:]
        assert "OK" in res.out


def test_detection_can_be_turned_off() -> None:
    ranks = run(PROGRAMS, "recv_cycle", n=2, timeout=4.0, warn=30.0, bound=60.0,
                env={"RANKWISE_DEADLOCK": "0"})
    check(ranks, "DistTimeout", "in recv from rank")


# --- post-mortem: RANKWISE_DUMP=dir and `rankwise analyze dir` ------------------------------

def test_dump_and_analyze_name_the_deadlock(tmp_path: object) -> None:
    dump = os.path.join(str(tmp_path), "dump")
    ranks = deadlocked("cross_group", 4, env={"RANKWISE_DUMP": dump})
    check(ranks, "DeadlockError", "deadlock: all 4 live ranks")
    assert sorted(os.listdir(dump)) == [f"rank{r}.json" for r in range(4)]
    done = _procs.run([sys.executable, "-m", "rankwise", "analyze", dump], timeout=60,
                      cwd=None)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    barrier = f"{P}:{line_of('cross-barrier', PROGRAMS)}"
    all_reduce = f"{P}:{line_of('cross-all-reduce', PROGRAMS)}"
    for needle in [
        "4 of 4 ranks wrote a dump",
        "uncaught DeadlockError: deadlock: all 4 live ranks",
        f"group [0, 1, 2, 3], collective #1: ranks 0-2 reached barrier() at {barrier}",
        "rank 3 never reached it (stopped at #0)",
        f"collective #2: rank 3 reached all_reduce(float32 x 4, op=SUM) at {all_reduce}",
        f"ranks 0-2: barrier() #1 of group [0, 1, 2, 3] at {barrier}",
        "waiting for rank 3, which has not reached it",
        "Wait-for cycle: rank 0 -> rank 3 -> rank 0.",
    ]:
        assert needle in out, f"analyze lacks {needle!r}:\n{out}"
