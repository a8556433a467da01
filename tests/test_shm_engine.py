"""The shared-memory engine behind the seam: selection, call order, no leftovers.

The core's own tests (``test_shm_core.py``) cover the protocol; the differential, error
and diagnosis suites run on both engines. These cover what only the integration does.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from typing import Any

import _procs
import numpy as np
import pytest

import rankwise as dist
from rankwise.testing import run_ranks


def _engine_names(rank: int, size: int) -> tuple[str, str]:
    sub = dist.new_group([0, 1])
    world = dist.group.WORLD.engine.name
    return world, sub.engine.name if sub is not dist.GroupMember.NON_GROUP_MEMBER else ""


@pytest.mark.parametrize(("asked", "expected"), [("auto", "shm"), ("tcp", "tcp"),
                                                   ("shm", "shm")])
@pytest.mark.procs
def test_engine_is_chosen_per_group(asked: str, expected: str) -> None:
    results = run_ranks(_engine_names, 3, env={"RANKWISE_ENGINE": asked}, timeout=60)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}"
    assert [r.value for r in results] == [(expected, expected)] * 2 + [(expected, "")]


def test_a_bad_engine_name_fails_before_any_connection(monkeypatch: Any) -> None:
    monkeypatch.setenv("RANKWISE_ENGINE", "infiniband")
    with pytest.raises(dist.InvalidArgument, match="RANKWISE_ENGINE='infiniband'"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0,
                                world_size=2, timeout=1)


def _async_then_blocking(rank: int, size: int, rounds: int) -> int:
    """Equal-sized async and blocking all_reduces back to back, as DDP buckets are:
    a blocking call that overtook the queued async one on one rank only would swap
    their data silently (equal fingerprints)."""
    wrong = 0
    for i in range(rounds):
        a = np.full(1024, rank + 1 + i, np.float64)
        b = np.full(1024, 1000.0 * (rank + 1) + i, np.float64)
        work = dist.all_reduce(a, async_op=True)
        if rank == 0:  # a different thread schedule per rank: rank 0's worker goes first
            time.sleep(0.002)
        dist.all_reduce(b)
        assert work is not None
        work.wait()
        wrong += int(not (a == sum(r + 1 + i for r in range(size))).all())
        wrong += int(not (b == sum(1000.0 * (r + 1) + i for r in range(size))).all())
    return wrong


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.procs
def test_blocking_call_never_overtakes_queued_async_calls(n: int) -> None:
    results = run_ranks(_async_then_blocking, n, args=(100,), timeout=90,
                        env={"RANKWISE_ENGINE": "shm"})
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        assert r.value == 0, f"rank {r.rank}: {r.value} results were another call's data"


_JOB = textwrap.dedent("""
    import os, signal, sys, numpy as np, rankwise as dist
    dist.init_process_group("gloo")
    t = np.ones(1 << 20, np.float32)
    dist.all_reduce(t)
    how = os.environ["HOW"]
    if dist.get_rank() == 1 and how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 1 and how == "raise":
        raise RuntimeError("boom")
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("method", ["memfd", "file"])
@pytest.mark.parametrize("how", ["clean", "raise", "sigkill"])
@pytest.mark.procs
def test_no_dev_shm_leftovers_after_any_exit(how: str, method: str, tmp_path: Any) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    before = _shm_entries()
    env = dict(os.environ, HOW=how, RANKWISE_ENGINE="shm", RANKWISE_SHM_METHOD=method)
    start = time.monotonic()
    proc = _procs.run([sys.executable, "-m", "rankwise", "run", "-n", "3", str(script)],
                      env=env, timeout=90, cwd=None)
    assert (proc.returncode == 0) == (how == "clean"), proc.stderr[-3000:]
    if how != "clean":  # the survivors were told, not left to time out
        assert time.monotonic() - start < 60
        assert "rank 1" in proc.stderr
    if how == "sigkill":
        assert f"signal {int(signal.SIGKILL)}" in proc.stderr or "SIGKILL" in proc.stderr
    left = {n for n in _shm_entries() - before if n.startswith("rankwise")}
    assert not left, f"left in /dev/shm: {sorted(left)}"
