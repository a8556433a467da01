"""The torch-gloo engine chosen by name (issue 13): backend ``"torch-gloo"``, or
``RANKWISE_ENGINE=torch-gloo`` with any CPU backend name; ``new_group`` on every engine;
``"gloo"`` stays rankwise's own engine. Real processes over real sockets.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.engines import select
from rankwise.engines.base import Caps
from rankwise.errors import InvalidArgument
from rankwise.testing import run_ranks

pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.timeout(180), pytest.mark.torch]


def _engines_and_sums(rank: int, world: int) -> dict[str, Any]:
    """Every group's engine, and a sum on each that proves its data moved."""
    out: dict[str, Any] = {"world": (dist.get_backend(), dist.group.WORLD.engine_name())}
    a = np.full(3, rank + 1.0, np.float32)
    dist.all_reduce(a)
    out["world_sum"] = a.tolist()
    sub = dist.new_group([0, 2])  # the default backend: the world's
    own = dist.new_group(backend="gloo")  # rankwise's own engine, whatever the world's
    torch_sub = dist.new_group([1, 2], backend="torch-gloo")
    for name, g in (("sub", sub), ("own", own), ("torch_sub", torch_sub)):
        if g is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        b = np.full(2, 10.0 * (rank + 1), np.float64)
        dist.all_reduce(b, group=g)
        out[name] = (dist.get_backend(g), g.engine_name(), b.tolist())
    return out


@pytest.mark.parametrize("how", ["backend", "env"])
@pytest.mark.procs
def test_torch_gloo_by_backend_name_or_env_with_new_groups(how: str) -> None:
    kwargs = {"backend": "torch-gloo"} if how == "backend" else {"backend": "gloo"}
    env = {"RANKWISE_ENGINE": "torch-gloo"} if how == "env" else {"RANKWISE_ENGINE": "tcp"}
    results = run_ranks(_engines_and_sums, 3, init_kwargs=kwargs, env=env, timeout=150)
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        v = res.value
        assert v["world"] == (kwargs["backend"], "torch-gloo")
        assert v["world_sum"] == [6.0] * 3
        # "gloo" is rankwise's own engine unless RANKWISE_ENGINE asks for torch-gloo
        assert v["own"] == ("gloo", "torch-gloo" if how == "env" else "tcp", [60.0] * 2)
        if res.rank in (0, 2):
            assert v["sub"] == (kwargs["backend"], "torch-gloo", [40.0] * 2)
        if res.rank in (1, 2):
            assert v["torch_sub"] == ("torch-gloo", "torch-gloo", [50.0] * 2)


def _torch_sub_in_tcp_world(rank: int, world: int) -> tuple[str, str, list[float], list[float]]:
    g = dist.new_group(backend="torch-gloo")
    a = np.arange(4, dtype=np.int64) * (rank + 1)
    dist.all_reduce(a, group=g)
    # PREMUL_SUM: each rank's factor applied before gloo's plain sum
    b = np.full(2, rank + 1.0, np.float32)
    dist.all_reduce(b, op=dist.ReduceOp.premul_sum(0.5 * (rank + 1)), group=g)
    return dist.group.WORLD.engine_name(), g.engine_name(), a.tolist(), b.tolist()


@pytest.mark.procs
def test_new_group_torch_gloo_in_a_tcp_world() -> None:
    results = run_ranks(_torch_sub_in_tcp_world, 2, env={"RANKWISE_ENGINE": "tcp"},
                        timeout=120)
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        assert res.value == ("tcp", "torch-gloo", [0, 3, 6, 9], [2.5, 2.5])


def test_torch_engine_without_torch_fails_before_io(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(select.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(InvalidArgument, match="needs torch"):
        select.requested_engine("torch-gloo")
    monkeypatch.setenv("RANKWISE_ENGINE", "torch-gloo")
    with pytest.raises(InvalidArgument, match="RANKWISE_ENGINE=torch-gloo needs torch"):
        # no store at this port: the error must come before any connection is tried
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0,
                                world_size=1, timeout=5)
    assert not dist.is_initialized()


@pytest.mark.procs
def test_check_overhead_benchmark_runs() -> None:
    """benchmarks/torch_engine.py (a short run; the ratios are measured on a quiet
    machine, not asserted here)."""
    import sys

    from launch_scripts.helpers import ROOT, env, run_bounded
    from test_torch_backend import TIMEOUT

    proc = run_bounded([sys.executable, str(ROOT / "benchmarks" / "torch_engine.py"),
                        "--iters", "30", "--blocks", "2"], env(), TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = dict(re.findall(r"^  (\S+(?: \S+)*?)\s+([\d.]+) us", proc.stdout, re.MULTILINE))
    assert set(rows) >= {"rankwise async", "rankwise sync", "rankwise off",
                         "torch all_reduce", "torch pg.allreduce"}, proc.stdout
    assert all(float(v) > 0 for v in rows.values()), proc.stdout


def _send_late(last: list[bool]) -> None:
    """The group's ring check (``api.observers``) sends its last batch only once rank 0
    has left: its own sends and the engine's (``Caps.held``)."""
    group = dist.group.WORLD
    check = next(kept[1] for key, kept in group.observers.items()
                 if isinstance(key, tuple) and key[0] == "ring")
    flush = check.flush

    def late_flush() -> None:
        if last[0] and check.deferred is not None:
            check.comm.router.wait_for_cause(0, 60.0)  # until rank 0 left
        flush()

    check.flush = late_flush
    group.engine.caps.held[:] = [late_flush]


def _next_rank_leaves_before_the_deferred_fingerprint(rank: int, world: int) -> list[float]:
    """A correct program: the same all_reduce three times (confirmed after the first, so
    later ones defer their fingerprint until the op is enqueued), then rank 0 leaves.
    Rank 1 is made to send its last deferred fingerprint only once rank 0 (its ring
    neighbour) is gone: the schedule a loaded machine produced in a full run."""
    a = np.ones(2, np.float32)
    last = [False]
    for i in range(3):
        last[0] = i == 2
        a[:] = 1.0
        dist.all_reduce(a)  # one call site: the same (fingerprint, site) every time
        if rank == 1 and i == 0:  # the group's ring check is made by its first call
            _send_late(last)
    if rank == 0:
        dist.destroy_process_group()
    return a.tolist()


@pytest.mark.procs
def test_a_neighbour_that_left_after_the_op_is_not_a_failure() -> None:
    results = run_ranks(_next_rank_leaves_before_the_deferred_fingerprint, 2,
                        init_kwargs={"backend": "torch-gloo"}, env={"RANKWISE_CHECK": "async"},
                        timeout=150)
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        assert res.value == [2.0, 2.0]



#: calls each rank makes after the divergence, at most, before the mismatch must be known
_AFTER = 200


def _confirmed_calls_diverge(rank: int, world: int, warm: int) -> tuple[int, str, str]:
    """Both all_reduce calls are confirmed during ``warm`` steps (their fingerprints then
    travel batched); then rank 1 takes the MAX branch while rank 0 keeps summing: equal
    sizes, so gloo completes both silently and only the ring check can tell. Returns the
    calls that returned after the divergence, and the error's type and message."""
    a = np.ones(4, np.float32)
    done = 0
    try:
        for i in range(warm + _AFTER):
            if (i % 2 == 1) if i < warm else rank == 1:
                dist.all_reduce(a, op=dist.ReduceOp.MAX)  # CALL:confirmed-max
            else:
                dist.all_reduce(a)  # CALL:confirmed-sum
            done += i >= warm
            a[:] = 1.0
    except dist.DistError as exc:
        return done, type(exc).__name__, str(exc)
    return done, "", ""  # the mismatch went unnoticed


@pytest.mark.procs
def test_a_mismatch_between_confirmed_calls_is_reported_within_a_batch() -> None:
    """Confirmed calls send their fingerprints in batches (``ring_check``): a mismatch
    the data plane accepts silently still raises CollectiveMismatch on every rank, naming
    both calls and the first mismatched collective, at most BATCH calls after it."""
    from _error_cases import line_of

    from rankwise.core.ring_check import BATCH

    warm = 6
    results = run_ranks(_confirmed_calls_diverge, 2, args=(warm,), timeout=150,
                        init_kwargs={"backend": "torch-gloo"},
                        env={"RANKWISE_CHECK": "async"})
    me = __file__.rsplit("/", 1)[-1]
    needles = ("op=MAX", "op=SUM", f"{me}:{line_of(__file__, '# CALL:confirmed-max')}",
               f"{me}:{line_of(__file__, '# CALL:confirmed-sum')}", f"collective #{warm + 1}:")
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        done, error, message = res.value
        assert error == "CollectiveMismatch", (res.rank, done, error, message)
        assert all(n.lower() in message.lower() for n in needles), (needles, message)
        assert done <= BATCH, (res.rank, done, message)


class _BlockingGroup:
    """A torch group whose ``shutdown`` blocks until released (a peer that never lets
    gloo's threads go), recording the calls it gets."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.calls: list[str] = []

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.release.wait(30)


def test_closing_a_torch_group_whose_shutdown_blocks_is_bounded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Leaving must stay bounded when torch's shutdown of a group blocks: ``close`` gives
    up after ``SHUTDOWN_LIMIT``, keeps the group alive (destroying it would block the
    same way) and says so, instead of hanging the rank's exit."""
    import threading
    import time
    from types import SimpleNamespace

    from rankwise.engines.torch import engine as torch_engine

    monkeypatch.setattr(torch_engine, "SHUTDOWN_LIMIT", 0.3)
    kept: list[Any] = []
    monkeypatch.setattr(torch_engine, "_keep", kept.append)
    pg = _BlockingGroup()
    fake = SimpleNamespace(
        caps=Caps(), _abort=None, _aborting=None, pg=pg,
        _check_lock=threading.Lock(), device=None, book=None, p2p=None, reverse=None,
        waiter=SimpleNamespace(stuck=False), name="torch-gloo",
        group=SimpleNamespace(name="the default group (WORLD)",
                              port=SimpleNamespace(on_failure=[])))
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="rankwise"):
        torch_engine.TorchEngine.close(fake)  # type: ignore[arg-type]
    elapsed = time.monotonic() - started
    pg.release.set()
    assert pg.calls == ["shutdown"]
    assert elapsed < 5, f"close took {elapsed:.1f}s"
    assert kept == [pg] and fake.pg is None
    assert "did not finish within" in caplog.text


def test_a_gloo_without_one_buffer_ops_falls_back_to_the_per_slot_way() -> None:
    """A torch whose gloo lacks ``_allgather_base``/``_reduce_scatter_base`` refuses the op
    before any I/O: the engine stops asking and takes the per-slot way; any other error of
    the enqueue is the call's."""
    from types import SimpleNamespace

    from rankwise.engines.torch.engine import TorchEngine

    def lacking(*args: Any) -> Any:
        raise RuntimeError("Backend gloo does not support _reduce_scatter_base")

    fake = SimpleNamespace(flat=True)
    assert TorchEngine._flat_op(fake, lacking, 1, 2) is None  # type: ignore[arg-type]
    assert fake.flat is False

    def broken(*args: Any) -> Any:
        raise RuntimeError("Connection closed by peer")

    fake.flat = True
    with pytest.raises(RuntimeError, match="Connection closed"):
        TorchEngine._flat_op(fake, broken)  # type: ignore[arg-type]
    assert fake.flat is True
    assert TorchEngine._flat_op(fake, lambda *a: ("work", a), 3) == ("work", (3,))  # type: ignore[arg-type]
