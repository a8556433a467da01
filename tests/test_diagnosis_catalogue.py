"""The catalogue of broken programs (issue 4): each ends on every rank, in seconds, with
the right error type and a report naming ranks, ops and file:line — and correct
programs stay silent.

Every rank is a real process started like a user's job (env:// init, uncaught
exceptions through ``sys.excepthook``); the programs are in ``test_diagnosis_programs.py``.
Short timeouts via the environment keep each case to a few seconds: the group timeout
(``RANKWISE_TIMEOUT``) is far above the bound each test asserts where the cause is known.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")
PROGRAMS = os.path.join(HERE, "test_diagnosis_programs.py")
TRAP = os.path.join(ROOT, "examples", "barrier_trap.py")

sys.path.insert(0, HERE)
from _procs import free_port, start
from _procs import run as run_command
from _zygote import Zygote
from test_diagnosis_programs import line_of

#: every test here runs once per engine (tcp, shm): see conftest.engine
pytestmark = [pytest.mark.procs, pytest.mark.timeout(90), pytest.mark.usefixtures("engine"), pytest.mark.torch_engines]

P = "test_diagnosis_programs.py"


@dataclass
class Rank:
    rank: int
    rc: int
    out: str
    err: str
    elapsed: float

    def _match(self) -> re.Match[str] | None:
        # a rankwise error's header comes first (a PeerFailure quotes the remote
        # traceback after it); other exceptions: the traceback's last header
        m = re.search(r"^rankwise\.errors\.(\w+): ", self.err, re.MULTILINE)
        if m:
            return m
        found = list(re.finditer(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): ", self.err, re.MULTILINE))
        return found[-1] if found else None

    @property
    def error(self) -> str:
        """Class name of the uncaught exception."""
        m = self._match()
        return m.group(1) if m else ""

    @property
    def message(self) -> str:
        m = self._match()
        return self.err[m.start():] if m else ""


#: torch engines: each rank imports torch before the clock starts and reports its own
#: elapsed time at exit, so a bound measures rankwise, not importing torch (tens of
#: seconds when several ranks import it at once on a loaded machine)
_TORCH_FIRST = (
    "import atexit, runpy, sys, time, torch\n"
    "t0 = time.monotonic()\n"
    "atexit.register(lambda: sys.stderr.write(f'\\n[rank-elapsed {time.monotonic() - t0:.3f}]\\n'))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")
_ELAPSED = re.compile(r"^\[rank-elapsed ([0-9.]+)\]$", re.MULTILINE)


#: the torch engines' ranks are forks of one server that imported torch once (see
#: ``_zygote``), each running ``_TORCH_FIRST`` as ``python -c`` would: torch's import cost
#: ~2.3 CPU-s per rank, ~78 s of this file's wall time on a 2-core machine
_zygote: Zygote | None = None


@pytest.fixture(autouse=True, scope="module")
def _close_zygote() -> Iterator[None]:
    yield
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


def _start(script: str, args: tuple[str, ...], env: dict[str, str]) -> Any:
    global _zygote
    if os.environ.get("RANKWISE_ENGINE", "").startswith("torch"):
        if _zygote is None:
            _zygote = Zygote(["torch"], {**os.environ, "PYTHONPATH": env["PYTHONPATH"]})
        return _zygote.start(_TORCH_FIRST, [script, *args], env)
    return start([sys.executable, script, *args], env=env, cwd=None)


def _elapsed(err: str, wall: float) -> float:
    found = _ELAPSED.search(err)
    return float(found.group(1)) if found else wall


def run(script: str, *args: str, n: int = 2, timeout: float = 10.0, warn: float = 30.0,
        env: dict[str, str] | None = None, bound: float = 40.0) -> list[Rank]:
    """Start ``n`` ranks of ``script`` and wait (hard bound ``bound`` s) for all of them."""
    port = free_port()
    procs = []
    starts = []
    for r in range(n):
        e = dict(os.environ)
        e.update({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "RANKWISE_TIMEOUT": str(timeout), "RANKWISE_WARN_AFTER": str(warn),
                  "PYTHONPATH": SRC + os.pathsep + e.get("PYTHONPATH", ""),
                  "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        starts.append(time.monotonic())
        procs.append(_start(script, args, e))
    deadline = time.monotonic() + bound
    results = []
    try:
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"rank {r} of {script} {args} still running after {bound}s")
            elapsed = _elapsed(err, time.monotonic() - starts[r])
            results.append(Rank(r, p.returncode, out, _ELAPSED.sub("", err).rstrip("\n")
                                + ("\n" if err.endswith("\n") and err.strip() else ""),
                                elapsed))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def case(name: str, **kw: object) -> list[Rank]:
    return run(PROGRAMS, name, **kw)  # type: ignore[arg-type]


def check(ranks: list[Rank], error: str, *needles: str, within: float | None = None,
          only: list[int] | None = None) -> None:
    for res in ranks:
        if only is not None and res.rank not in only:
            continue
        assert res.error == error, (f"rank {res.rank}: expected {error}, got "
                                    f"{res.error or 'no error'} (rc {res.rc}):\n{res.err[-3000:]}")
        for needle in needles:
            assert needle in res.message, (f"rank {res.rank}: {error} lacks {needle!r}:\n"
                                           f"{res.message[:4000]}")
        if within is not None:
            assert res.elapsed < within, f"rank {res.rank} ended after {res.elapsed:.1f}s"


# --- the seed trap -----------------------------------------------------------------------

def test_seed_trap_names_the_validation_loader_barrier() -> None:
    ranks = run(TRAP, n=4, timeout=30.0)
    release = line_of("release", TRAP)
    val = line_of("val", TRAP)
    end = line_of("end-of-epoch", TRAP)
    average = line_of("average", TRAP)
    check(ranks, "CollectiveMismatch",
          "Where the ranks diverged: collective #3",
          f"rank 0 reached barrier() at barrier_trap.py:{release} in "
          "torch_distributed_zero_first <- barrier_trap.py:",
          f"in create_dataloader <- barrier_trap.py:{val} in main",
          f"all_reduce(float32 x 8, op=SUM) at barrier_trap.py:{average}",
          "collective #4", within=15.0)
    for res in ranks:  # a rank too busy to answer the report's query (2 s, seen under
        # heavy load) is said so, and left out of the ranks named at #3
        late = [r for r in (1, 2, 3) if f"rank {r}: did not answer" in res.message]
        named = ", ".join(str(r) for r in (1, 2, 3) if r not in late)
        side = "ranks 1-3" if not late else f"rank{'s' if len(late) < 2 else ''} {named}"
        assert f"{side} reached barrier() at barrier_trap.py:{end} in main" in res.message, \
            res.message[:4000]


def test_seed_trap_under_the_launcher() -> None:
    """The acceptance command itself: ``python -m rankwise run -n 4 examples/barrier_trap.py``."""
    start = time.monotonic()
    done = run_command([sys.executable, "-m", "rankwise", "run", "-n", "4", TRAP],
                       env={**os.environ, "PYTHONPATH": SRC, "RANKWISE_TIMEOUT": "60"},
                       timeout=60, cwd=None)
    took = time.monotonic() - start
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "CollectiveMismatch" in out
    assert "Where the ranks diverged: collective #3" in out
    assert f"in create_dataloader <- barrier_trap.py:{line_of('val', TRAP)} in main" in out
    # well inside the 60 s timeout: the mismatch ended the job, not the timeout (the
    # bound leaves room for starting 4 torch processes on a loaded machine: 32 s once,
    # on 2 cores beside two valgrind runs, where the job itself is ~10 s)
    assert took < 45, f"took {took:.1f}s"


def test_seed_trap_fixed_runs_clean_and_silent() -> None:
    ranks = run(TRAP, "--fixed", n=4, timeout=30.0, warn=1.0)
    for res in ranks:
        assert res.rc == 0, res.err[-3000:]
        assert res.err.strip() == "", res.err[-3000:]
    assert "PASS (fixed)" in ranks[0].out


def test_seed_trap_with_rank_zero_first_names_the_trap() -> None:
    ranks = run(TRAP, "--safe", n=4, timeout=30.0)
    check(ranks, "CollectiveMismatch", "rank-0-first trap", "rank_zero_first(",
          f"barrier_trap.py:{line_of('end-of-epoch', TRAP)}", within=15.0)


# --- mismatches ----------------------------------------------------------------------------

def test_barrier_on_a_subset_of_ranks() -> None:
    ranks = case("subset_barrier", n=3)
    # rank 0 may still be finishing #1 when the report is taken (recursive doubling on 3
    # ranks hands it the result last), so the report names "rank 1" or "ranks 0, 1" there
    check(ranks, "CollectiveMismatch", "Where the ranks diverged: collective #2",
          f"rank 2 reached all_reduce(float32 x 4, op=SUM) at {P}:{line_of('subset-after')}",
          f"reached barrier() at {P}:{line_of('subset-barrier')}", within=15.0)


def test_uneven_batches() -> None:
    ranks = case("uneven_batches")
    check(ranks, "CollectiveMismatch", "collective #5",
          f"rank 0 reached all_reduce(float32 x 4, op=SUM) at {P}:{line_of('uneven-step')}",
          f"rank 1 reached all_reduce(float32 x 1, op=SUM) at {P}:{line_of('uneven-metric')}",
          "Up to #4 every rank made the same calls", within=15.0)


@pytest.mark.parametrize("name,needles", [
    ("shape", ["collective #2", "all_reduce(float32 x 4, op=SUM)",
               "all_reduce(float32 x 5, op=SUM)"]),
    ("dtype", ["broadcast(float32 x 4, root=0)", "broadcast(int64 x 4, root=0)"]),
    ("root", ["gather(float32 x 2, root=0)", "gather(float32 x 2, root=1)"]),
    ("op", ["all_reduce(float32 x 4, op=SUM)", "all_reduce(float32 x 4, op=MAX)"]),
])
def test_argument_mismatches(name: str, needles: list[str]) -> None:
    # crossed roots: no frame crosses (each rank waits to receive); the who-is-where
    # check at the warning threshold finds the mismatch, long before the timeout
    ranks = case(name, warn=1.0)
    check(ranks, "CollectiveMismatch", *needles, f"{P}:{line_of(name)}",
          "Where the ranks diverged", "rank 0", "rank 1", within=15.0)


def test_barrier_names_must_match() -> None:
    ranks = case("barrier_names")
    check(ranks, "CollectiveMismatch", "collective #2", "name='checkpoint'",
          "name='epoch-end'", f"{P}:{line_of('named')}", within=15.0)


# --- failures --------------------------------------------------------------------------------

def test_rank_raising_mid_epoch() -> None:
    ranks = case("raises")
    assert ranks[1].error == "ValueError"
    check(ranks, "PeerFailure", "rank 1 failed: ValueError: corrupt batch in shard 1",
          f'line {line_of("raise")}', "its last collective: all_reduce(float32 x 4, op=SUM) "
          f"at {P}:{line_of('raise-step')}", "rank 0 was in all_reduce", only=[0], within=15.0)


def test_rank_exiting_early() -> None:
    ranks = case("exits_early")
    assert ranks[1].rc == 0, ranks[1].err
    check(ranks, "PeerFailure",
          f"rank 1 finished and called destroy_process_group at {P}:{line_of('leave')}",
          f"while rank 0 waits in all_reduce(float32 x 4, op=SUM) #2 (group 0) at "
          f"{P}:{line_of('early-step')}", only=[0], within=15.0)


def test_rank_killed_with_sigkill() -> None:
    ranks = case("killed")
    assert ranks[1].rc == -9
    check(ranks, "PeerFailure", "rank 1 died", "without a goodbye",
          f"Last collective seen from rank 1: all_reduce(float32 x 4, op=SUM) at "
          f"{P}:{line_of('killed-step')}", only=[0], within=15.0)


def test_rank_stuck_in_a_long_computation() -> None:
    ranks = case("stuck", timeout=3.0, warn=1.0, env={"STUCK_FOR": "6"})
    zero = ranks[0]
    # the warning table, logged once the wait passed RANKWISE_WARN_AFTER
    assert "slow wait on rank 0" in zero.err and "who is where" in zero.err, zero.err
    check(ranks, "DistTimeout", "timed out after 3s in barrier()",
          f"at {P}:{line_of('stuck-barrier')}", "waiting for rank 1", "who is where",
          f"rank 1: running user code at {P}:", f" in _busy <- {P}:{line_of('busy')} in stuck",
          f"last call: barrier() at {P}:", only=[0],
          within=12.0)
    # rank 1 comes back from its computation and learns why rank 0 is gone
    check(ranks, "PeerFailure", "rank 0 failed: DistTimeout", only=[1])


def test_enqueued_is_told_apart_from_never_called(engine: str) -> None:
    """Issue 13's who-is-where for foreign engines: a rank whose op torch holds is
    "enqueued ..., not finished after N s"; the rank that never called it says so."""
    ranks = case("stuck_in_loop", timeout=3.0, warn=1.0, env={"STUCK_FOR": "6"})
    call = "all_reduce(float32 x 4, op=SUM)"
    check(ranks, "DistTimeout", f"timed out after 3s in {call}", "who is where",
          f"rank 1: running user code at {P}:", f"in stuck_in_loop <- {P}:", only=[0],
          within=12.0)
    if engine.startswith("torch"):
        assert re.search(rf"rank 0: enqueued {re.escape(call)} #2 of .* on {engine} at "
                         rf"{P}:{line_of('loop-step')} in stuck_in_loop.*, op not finished "
                         r"after \d", ranks[0].message), ranks[0].message
        assert f"; never called {call} #2" in ranks[0].message, ranks[0].message
    else:  # rankwise's engines: the op is rankwise's own wait for rank 1's data
        assert f"rank 0: in {call} #2 of" in ranks[0].message, ranks[0].message


# --- large messages: the waiting thread reads for itself (transport drive) ---------------
# Failures must still reach it at once, and reports must still get the peers' answers
# (which only a reader brings in) when the wait ends in an error or a warning.

LARGE = 1 << 18


def test_large_shape_mismatch_gets_the_divergence_report() -> None:
    ranks = case("shape", warn=1.0, env={"NUMEL": str(LARGE)})
    check(ranks, "CollectiveMismatch", f"all_reduce(float32 x {LARGE}, op=SUM)",
          f"all_reduce(float32 x {LARGE + 1}, op=SUM)", f"{P}:{line_of('shape')}",
          "Where the ranks diverged", within=15.0)


def test_large_all_reduce_with_a_killed_peer() -> None:
    ranks = case("killed", env={"NUMEL": str(LARGE)})
    assert ranks[1].rc == -9
    check(ranks, "PeerFailure", "rank 1 died", "without a goodbye",
          f"Last collective seen from rank 1: all_reduce(float32 x {LARGE}, op=SUM) at "
          f"{P}:{line_of('killed-step')}", only=[0], within=15.0)


def test_large_all_reduce_waiting_for_a_stuck_peer() -> None:
    ranks = case("stuck_large", timeout=3.0, warn=1.0, env={"STUCK_FOR": "6",
                                                           "NUMEL": str(LARGE)})
    zero = ranks[0]
    assert "slow wait on rank 0" in zero.err and "who is where" in zero.err, zero.err
    check(ranks, "DistTimeout", f"timed out after 3s in all_reduce(float32 x {LARGE}, op=SUM)",
          f"at {P}:{line_of('stuck-large')}", "who is where", f"rank 1: running user code at {P}:",
          " in _busy <- ",
          only=[0], within=12.0)


def test_p2p_cycle_is_named() -> None:
    # with deadlock detection off, as before it: the warning table names the cycle. The rank
    # that reached its recv last sees the other already blocked when it warns (a loaded
    # machine can stall either rank for seconds, so the earlier one may warn too soon)
    ranks = case("p2p_cycle", timeout=5.0, warn=1.0, env={"RANKWISE_DEADLOCK": "0"})
    recv_line = f"{P}:{line_of('cycle-recv')}"
    cycle = (f"DEADLOCK: rank 0 waits for rank 1 (recv at {recv_line} in p2p_cycle), "
             f"which waits for rank 0 (recv at {recv_line}")
    assert any(cycle in res.err for res in ranks), [res.err for res in ranks]
    check(ranks, "DistTimeout", "in recv from rank", "who is where", within=14.0)


def test_p2p_cycle_ends_in_a_deadlock_error() -> None:
    # detection on (the default): no timeout needed, no warning timer (test_deadlock.py)
    ranks = case("p2p_cycle", timeout=60.0, bound=60.0)
    recv_line = f"{P}:{line_of('cycle-recv')}"
    check(ranks, "DeadlockError", f"rank 0: recv from rank 1 at {recv_line}",
          f"rank 1: recv from rank 0 at {recv_line}", "Wait-for cycle", within=15.0)


def test_monitored_barrier_names_the_missing_rank() -> None:
    ranks = case("monitored", n=3)
    check(ranks, "DistTimeout", "rank 1 did not reach it within 1s",
          f"monitored_barrier at {P}:{line_of('monitored')}", "rank 1: running user code",
          only=[0], within=12.0)
    check(ranks, "DistTimeout", "rank 0 reports that rank 1 did not reach it", only=[2])


def test_rank_zero_first_forwards_rank_zeros_exception() -> None:
    ranks = case("zero_first_raises", n=3)
    assert ranks[0].error == "OSError"
    check(ranks, "PeerFailure", "rank 0 failed: OSError: download failed",
          f"inside rank_zero_first at {P}:{line_of('rzf-with')}",
          f'line {line_of("rzf-raise")}', only=[1, 2], within=15.0)


# --- correct programs stay silent -------------------------------------------------------------

def test_correct_program_is_silent_with_diagnosis_on() -> None:
    # rank 0's block outlasts both the collective timeout and the warning threshold (the
    # timeout bounds init's rendezvous too: 1 s was too short for 3 interpreters to start
    # on a loaded 2-core machine)
    ranks = case("zero_first_slow_ok", n=3, timeout=4.0, warn=0.5, env={"BLOCK_FOR": "5"})
    for res in ranks:
        assert res.rc == 0, res.err[-3000:]
        assert res.err.strip() == "", res.err[-3000:]
        assert "OK" in res.out


def test_trace_files_and_merge(tmp_path: object) -> None:
    trace_dir = os.path.join(str(tmp_path), "trace")
    ranks = case("traced", env={"RANKWISE_TRACE": trace_dir})
    for res in ranks:
        assert res.rc == 0, res.err
    assert sorted(os.listdir(trace_dir)) == ["rank0.json", "rank1.json"]
    out = os.path.join(str(tmp_path), "merged.json")
    done = run_command([sys.executable, "-m", "rankwise.diagnosis.trace", "merge",
                        trace_dir, "-o", out], env={**os.environ, "PYTHONPATH": SRC},
                       timeout=30, cwd=None)
    assert done.returncode == 0, done.stderr
    with open(out) as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    steps = [e for e in spans if e["name"] == "all_reduce" and e["pid"] == 1]
    assert [e["args"]["seq"] for e in steps] == [1, 2, 3]
    assert steps[0]["args"]["bytes"] == 32
    assert f"{P}:{line_of('traced-step')}" in steps[0]["args"]["site"]
    labelled = [e for e in spans if e["name"] == "sync point"]  # dist.record_comm's
    assert {e["pid"] for e in labelled} == {0, 1}
    assert {e["args"]["op"] for e in labelled} == {"barrier"}
    assert not any(e["name"] == "barrier" for e in spans)
    recv = [e for e in spans if e["name"] == "recv"]
    assert recv and recv[0]["args"]["peer"] == 0 and recv[0]["pid"] == 1
    assert any(e["ph"] == "M" and e["args"].get("name") == "rank 1" for e in events)
