"""Peer failures (issue 2, item 9): a rank that is killed, raises, or leaves reaches every
rank still waiting on it as ``PeerFailure`` naming it — at once, not at the timeout.

Group timeouts here are 10-20 s; every failure must arrive within a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _error_cases import SRC, finish, line_of, run_script
from _zygote import Zygote

import rankwise as dist
from rankwise.testing import free_port, run_ranks

ME = os.path.basename(__file__)
#: every test here runs once per engine (tcp, shm): see conftest.engine
pytestmark = [pytest.mark.procs, pytest.mark.usefixtures("engine"), pytest.mark.torch_engines]


def _caught(fn: Any) -> dict[str, Any]:
    """Run ``fn``; describe the exception it raised (with its attributes)."""
    start = time.monotonic()
    try:
        value = fn()
    except dist.DistError as exc:
        return {"type": type(exc).__name__,
                "mro": [c.__name__ for c in type(exc).__mro__],
                "rank": getattr(exc, "rank", None),
                "remote_traceback": getattr(exc, "remote_traceback", ""),
                "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None, "value": value, "elapsed": time.monotonic() - start}


def _check_peer_failure(info: dict[str, Any], rank: int, bound: float,
                        *needles: str) -> None:
    assert info["type"] is not None, f"no error: {info}"
    assert "PeerFailure" in info["mro"], info
    assert info["rank"] == rank, f"rank {info['rank']} named, not {rank}: {info['message']}"
    assert f"rank {rank}" in info["message"], info["message"]
    for n in needles:
        assert n in info["message"], f"{n!r} not in {info['message']}"
    assert info["elapsed"] < bound, f"PeerFailure after {info['elapsed']:.1f}s: {info}"


# --- SIGKILL ---------------------------------------------------------------------------------


def _killed(rank: int, world: int, victim: int, nbytes: int) -> Any:
    a = np.ones(nbytes // 4, np.float32)
    dist.all_reduce(a)  # everyone is up and connected
    if rank == victim:
        time.sleep(0.3)  # the others are blocked in all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)

    def loop() -> None:
        for _ in range(10_000):
            dist.all_reduce(a)

    first = _caught(loop)
    # later calls fail at once with the same story, and p2p to the dead rank too
    again = _caught(lambda: dist.all_reduce(a))
    p2p = _caught(lambda: dist.recv(np.zeros(1, np.float32), src=victim))
    return first, again, p2p


def test_sigkill_during_all_reduce_reaches_every_waiting_rank() -> None:
    victim = 2
    for nbytes in (64, 4 << 20):  # latency path (doubling) and bandwidth path (ring)
        results = run_ranks(_killed, 4, args=(victim, nbytes), timeout=60,
                            init_kwargs={"timeout": 20.0})
        assert results[victim].exitcode == -signal.SIGKILL
        for r in results:
            if r.rank == victim:
                continue
            assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}"
            first, again, p2p = r.value
            _check_peer_failure(first, victim, 5.0, "died")
            _check_peer_failure(again, victim, 1.0)
            _check_peer_failure(p2p, victim, 1.0)


def _recv_from_dead(rank: int, world: int) -> Any:
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    got = np.zeros(3, np.float32)
    blocking = _caught(lambda: dist.recv(got, src=1))
    work = _caught(lambda: dist.irecv(got, src=1).wait())
    anysrc = _caught(lambda: dist.send(got, dst=1))
    return blocking, work, anysrc


def test_p2p_with_a_dead_rank_is_a_peer_failure() -> None:
    results = run_ranks(_recv_from_dead, 2, timeout=60, init_kwargs={"timeout": 20.0})
    assert results[1].exitcode == -signal.SIGKILL
    assert results[0].ok, f"{results[0].error_type}: {results[0].message}"
    blocking, work, send = results[0].value
    _check_peer_failure(blocking, 1, 5.0)
    _check_peer_failure(work, 1, 1.0)
    _check_peer_failure(send, 1, 1.0)


# --- leaving early ---------------------------------------------------------------------------


def _leaves_early(rank: int, world: int) -> Any:
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.2)
        dist.destroy_process_group()  # LEAVE-HERE
        return "left"
    info = _caught(lambda: dist.barrier())  # WAIT-HERE
    p2p = _caught(lambda: dist.recv(np.zeros(1, np.float32), src=world - 1))
    return info, p2p


def test_rank_that_leaves_early_is_named_with_its_destroy_call_site() -> None:
    world = 3
    results = run_ranks(_leaves_early, world, timeout=60, init_kwargs={"timeout": 20.0})
    leave_line = line_of(__file__, "# LEAVE-HERE")
    wait_line = line_of(__file__, "# WAIT-HERE")
    assert results[-1].ok and results[-1].value == "left"
    for r in results[:-1]:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}"
        info, p2p = r.value
        _check_peer_failure(info, world - 1, 5.0, "destroy_process_group",
                            f"{ME}:{leave_line}")
        assert "barrier" in info["message"] and f"{ME}:{wait_line}" in info["message"], info
        _check_peer_failure(p2p, world - 1, 1.0)


# --- an uncaught exception (sys.excepthook sends the traceback) ------------------------------

#: on a torch engine the ranks are forks of one server that imported torch once
#: (``_zygote``; each still a fresh ``python -c`` as far as rankwise sees): each rank
#: imported torch at init, 3 ranks x 3 cases
_zygotes: list[Zygote] = []


def _torch_ranks(engine: str) -> Zygote | None:
    if not engine.startswith("torch"):
        return None
    if not _zygotes:
        _zygotes.append(Zygote(["torch"], {**os.environ, "PYTHONPATH": os.pathsep.join(
            [SRC, os.environ.get("PYTHONPATH", "")])}))
    return _zygotes[0]


@pytest.fixture(autouse=True, scope="module")
def _close_zygote() -> Iterator[None]:
    yield
    while _zygotes:
        _zygotes.pop().close()


_CHILD = """
import json, sys, time
import numpy as np
import rankwise as dist

rank, port, op, victim = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=3, timeout=20.0)
a = np.ones(4, np.float32)
dist.all_reduce(a)
if rank == victim:
    time.sleep(0.3)
    def load_batch(i):
        raise KeyError(f"batch {i} is missing from the shard")
    load_batch(7)  # uncaught: the excepthook tells the others
start = time.monotonic()
try:
    if op == "new_group":  # a store round: the failure must reach it too
        dist.new_group([0, 1, 2])
    else:
        dist.all_reduce(a)
    out = {"type": None}
except dist.DistError as exc:
    out = {"type": type(exc).__name__, "rank": getattr(exc, "rank", None),
           "tb": getattr(exc, "remote_traceback", ""), "message": str(exc),
           "cause": repr(exc.__cause__) if exc.__cause__ is not None else None}
out["elapsed"] = time.monotonic() - start
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("op,victim", [
    ("all_reduce", 1),
    # the others wait in new_group's store round, not on a peer: the store stays up
    # (rank 0 hosts it), or its host is the rank that failed ("the store went away"
    # must not hide the cause)
    ("new_group", 1), ("new_group", 0)])
def test_uncaught_exception_reaches_peers_with_its_traceback(op: str, victim: int,
                                                            engine: str) -> None:
    port = free_port()
    zygote = _torch_ranks(engine)
    procs = [run_script(_CHILD, str(r), str(port), op, str(victim), zygote=zygote)
             for r in range(3)]
    outs = finish(procs, timeout=40)
    code, _, err = outs[victim]
    assert code == 1 and "KeyError" in err, (code, err[-2000:])
    for r in sorted(set(range(3)) - {victim}):
        code, out, err = outs[r]
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rank {r} printed no result (exit {code}):\n{err[-3000:]}"
        info = json.loads(lines[-1][7:])
        assert info["type"] == "PeerFailure", info
        assert info["rank"] == victim, info
        assert info["elapsed"] < 5.0, info
        assert "KeyError" in info["message"] and "batch 7" in info["message"], info
        assert "load_batch" in info["tb"] and "KeyError" in info["tb"], info["tb"]
        # a store lost with its host is a consequence: never printed as "the direct cause"
        assert info["cause"] is None, info["cause"]


# --- user recv(src=None) never swallows library traffic --------------------------------------


def _any_source(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    buf = np.zeros(3, np.float32)
    if rank == 0:
        # posted before any traffic: only user sends may complete it
        early = dist.irecv(buf, src=None, tag=0)
    for step in range(3):
        a = np.full(4, float(rank), np.float32)
        dist.all_reduce(a)
        if a.tolist() != [float(sum(range(world)))] * 4:
            problems.append(f"step {step}: all_reduce {a.tolist()}")
        objs: list[Any] = [None]
        if rank == 1:
            dist.send_object_list([{"step": step}], dst=0)
        elif rank == 0:
            src = dist.recv_object_list(objs, src=None)
            if (src, objs) != (1, [{"step": step}]):
                problems.append(f"step {step}: object {src} {objs}")
        b = np.full(2, 5.0 if rank == 2 else 0.0, np.float32)
        dist.broadcast(b, src=2)
        if b.tolist() != [5.0, 5.0]:
            problems.append(f"step {step}: broadcast {b.tolist()}")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rank * 10 + step)
        if gathered != [r * 10 + step for r in range(world)]:
            problems.append(f"step {step}: all_gather_object {gathered}")
    if rank == 0:
        if early.is_completed():
            problems.append(f"user irecv(src=None) completed by library traffic: {buf}")
        dist.barrier()  # ranks 1 and 2 send now
        early.wait()
        first = (early.source_rank(), buf.tolist())
        second_buf = np.zeros(3, np.float32)
        second = (dist.recv(second_buf, src=None, tag=0), second_buf.tolist())
        got = sorted([first, second])
        if got != [(1, [1.0] * 3), (2, [2.0] * 3)]:
            problems.append(f"user messages: {got}")
    else:
        dist.barrier()
        dist.send(np.full(3, float(rank), np.float32), dst=0, tag=0)
    dist.barrier()
    return problems


def test_any_source_recv_never_swallows_library_traffic() -> None:
    results = run_ranks(_any_source, 3, timeout=60, init_kwargs={"timeout": 10.0})
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        assert r.value == [], f"rank {r.rank}: {r.value}"


# --- a wait nobody answers is bounded by the group timeout -----------------------------------


def _unanswered(rank: int, world: int, flag: str) -> Any:
    dist.barrier()
    if rank == 0:
        buf = np.zeros(2, np.float32)
        short = _caught(lambda: dist.irecv(buf, src=1, tag=5).wait(timeout=0.5))
        recv = _caught(lambda: dist.recv(buf, src=1, tag=9))  # RECV-HERE
        with open(flag, "w"):
            pass
        return short, recv
    # rank 1 is alive but never sends: rank 0 must give up on its own; rank 1 stays
    # until rank 0 is done (its leaving would end rank 0's wait as a PeerFailure)
    deadline = time.monotonic() + 30.0
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition, bounded; not a guess at timing
    return None


def test_unanswered_waits_end_at_the_timeout_naming_the_call(tmp_path: Any) -> None:
    results = run_ranks(_unanswered, 2, args=(str(tmp_path / "rank0-done"),), timeout=60,
                        init_kwargs={"timeout": 2.0})
    assert results[0].ok, f"{results[0].error_type}: {results[0].message}"
    short, recv = results[0].value
    for info, bound in ((short, 0.5), (recv, 2.0)):
        assert "DistTimeout" in info["mro"], info
        assert bound - 0.1 < info["elapsed"] < bound + 2.0, info
        # the report names the limit that applied: wait(timeout=) or the group's
        assert f"timed out after {bound:g}s in recv" in info["message"], info["message"]
    line = line_of(__file__, "# RECV-HERE")
    assert "rank 1" in recv["message"] and f"{ME}:{line}" in recv["message"], recv["message"]
