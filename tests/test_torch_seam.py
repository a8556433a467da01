"""Issue 47: backend "rankwise" is one torch sees as its own. Each of torch's seams (flight
recorder, health check, ``split_group``, ``set_timeout``, ``monitored_barrier``,
``gather_single``, ``device_id=``, ``supports_*``, ``new_group`` through the default
group) is tried on "rankwise" and on a gloo group in the same two-rank job, and must end
alike; a seam the running torch lacks skips. One job serves every test (module fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _procs import SRC

torch = pytest.importorskip("torch")
import torch.distributed as tdist

from rankwise.testing import run_ranks

pytestmark = [pytest.mark.torch, pytest.mark.procs, pytest.mark.timeout(300)]

VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
C10D: Any = torch._C._distributed_c10d
Outcome = tuple[Any, ...]


def _outcome(fn: Any, backend: str) -> Outcome:
    """``("ok", value)`` or ``("error", type, message)`` with the backend's name taken out,
    so that one refusal worded for gloo and for rankwise compares equal."""
    try:
        return ("ok", fn())
    except AttributeError as exc:  # the running torch lacks the API itself
        return ("absent", str(exc)[:200])
    except Exception as exc:  # noqa: BLE001 - compared between the backends
        return ("error", type(exc).__name__, str(exc).replace(backend, "<backend>")[:200])


def _sum(group: Any) -> list[float]:
    t = torch.ones(1)
    tdist.all_reduce(t, group=group)
    return t.tolist()


def _completed_after_wait(group: Any) -> tuple[bool, list[float]]:
    """An async all_reduce's ``is_completed()`` once ``wait()`` returned (a loop polling it
    must end), and its result."""
    t = torch.ones(1)
    work = tdist.all_reduce(t, group=group, async_op=True)
    assert work is not None
    work.wait()
    return work.is_completed(), t.tolist()


def _fr_count(backend: str) -> int:
    import pickle

    dump = pickle.loads(C10D._dump_fr_trace(backend=backend))
    return sum(1 for e in dump["entries"] if e["profiling_name"].startswith(f"{backend}:"))


def _timed_out(group: Any, rank: int, store: Any, tag: str) -> str:
    """``set_timeout(1 s)``, then rank 0 waits in a barrier rank 1 never joins: how long it
    took to raise. Rank 1 waits on the store until rank 0 is done."""
    tdist.set_timeout(timedelta(seconds=1), group=group)
    if rank == 1:
        store.wait([tag], timedelta(seconds=120))
        return "waited"
    start = time.monotonic()
    try:
        tdist.barrier(group=group)
        return "returned"
    except Exception:  # noqa: BLE001 - the test reads the time
        return "raised within 10 s" if time.monotonic() - start < 10.0 else "raised late"
    finally:
        store.set(tag, "1")


def _seam(rank: int, world: int, path: str, dumps: str) -> dict[str, dict[str, Outcome]]:
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(dumps, "rank_")
    import rankwise.torch  # noqa: F401 - registers backend "rankwise"

    store = tdist.FileStore(path, world)
    kwargs: dict[str, Any] = {"device_id": torch.device("cpu", 0)} if VERSION >= (2, 15) \
        else {}
    tdist.init_process_group("rankwise", store=store, rank=rank, world_size=world,
                             timeout=timedelta(seconds=60), **kwargs)
    world_pg = tdist.group.WORLD
    gloo_kwargs = dict(kwargs)
    gloo = tdist.new_group([0, 1], backend="gloo", **gloo_kwargs)
    pgs = {"rankwise": world_pg, "gloo": gloo}
    out: dict[str, dict[str, Outcome]] = {k: {"sum": _outcome(lambda pg=pg: _sum(pg), k)}
                                          for k, pg in pgs.items()}
    # recorded and dumped before split_group makes groups that differ per rank, which
    # fr_trace cannot match (KeyError), gloo's dumps alike
    for name in pgs:
        out[name]["recorded"] = _outcome(lambda name=name: _fr_count(name) > 0, name)
    out["rankwise"]["dumped"] = _outcome(
        lambda: C10D._dump_fr_trace_file(rank, backend="rankwise"), "rankwise")
    for name, pg in pgs.items():
        o = out[name]
        o["device_id"] = _outcome(lambda pg=pg: str(pg.bound_device_id), name)
        o["device_types"] = _outcome(lambda pg=pg: sorted(d.type for d in pg._device_types),
                                     name)
        o["supports"] = _outcome(lambda pg=pg: (type(pg.supports_abort_hooks).__name__,
                                                type(pg.supports_reconfigure).__name__), name)
        o["hooks"] = _outcome(lambda pg=pg: pg._has_hooks(), name)
        o["completed"] = _outcome(lambda pg=pg: _completed_after_wait(pg), name)
        o["monitored_barrier"] = _outcome(
            lambda pg=pg: tdist.monitored_barrier(pg, timeout=timedelta(seconds=30)), name)

        def gather_single(pg: Any = pg) -> Any:
            got = torch.zeros(2) if rank == 0 else None
            tdist.gather_single(torch.ones(1) * (rank + 1), got, group=pg, group_dst=0)
            return None if got is None else got.tolist()
        o["gather_single"] = _outcome(gather_single, name)

        def split(pg: Any = pg) -> Any:
            sub = tdist.split_group(parent_pg=pg, split_ranks=[[0], [1]])
            return (tdist.get_backend(sub), _sum(sub))
        o["split_group"] = _outcome(split, name)
    # the default group is bound to a device: torch makes its subgroups through it
    out["rankwise"]["new_group"] = _outcome(lambda: _sum(tdist.new_group([0, 1])), "rankwise")
    out["gloo"]["new_group"] = _outcome(lambda: _sum(tdist.new_group([0, 1],
                                                                      backend="gloo")), "gloo")
    for name, pg in pgs.items():  # last: a timeout leaves a group unusable
        out[name]["set_timeout"] = _outcome(
            lambda name=name, pg=pg: _timed_out(pg, rank, store, f"done-{name}"), name)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    base = tmp_path_factory.mktemp("seam")
    dumps = base / "dumps"
    dumps.mkdir()
    results = run_ranks(_seam, 2, args=(str(base / "store"), str(dumps)), init=False,
                        timeout=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
    return [r.value for r in results], dumps


def _alike(job: tuple[list[Any], Path], item: str) -> list[Outcome]:
    """Rank by rank, the item's outcome on "rankwise", asserted equal to gloo's; skips where
    this torch lacks the API."""
    per_rank, _ = job
    got = []
    for rank, out in enumerate(per_rank):
        mine, gloo = out["rankwise"][item], out["gloo"][item]
        if gloo[0] == "absent":
            pytest.skip(f"torch {torch.__version__} has no {item}: {gloo[1]}")
        assert mine == gloo, f"rank {rank}: rankwise {mine} vs gloo {gloo}"
        got.append(mine)
    return got



def test_collectives_run_on_both(job: Any) -> None:
    assert _alike(job, "sum") == [("ok", [2.0])] * 2


def test_device_id_at_init(job: Any) -> None:
    if VERSION < (2, 15):
        pytest.skip("torch before 2.15 refuses a CPU device_id (gloo too)")
    assert _alike(job, "device_id") == [("ok", "cpu:0")] * 2


def test_backends_registered_for_torchs_devices(job: Any) -> None:
    """``_device_types`` is what the recorder, the health check and monitored_barrier
    ask; the subclass route (torch before 2.14) has none."""
    if VERSION < (2, 14):
        pytest.skip("torch before 2.14 has no Python Backend: the subclass has no devices")
    assert all(o[0] == "ok" and "cpu" in o[1] for o in _alike(job, "device_types"))


def test_async_work_is_completed_after_wait(job: Any) -> None:
    """On 2.15 torch holds a Python backend's ``Work`` in a C++ holder whose own
    ``is_completed`` stayed False."""
    assert _alike(job, "completed") == [("ok", (True, [2.0]))] * 2


def test_supports_answer(job: Any) -> None:
    for outcome in _alike(job, "supports"):
        assert outcome == ("ok", ("bool", "bool"))


def test_health_check_as_gloo(job: Any) -> None:
    """torch attaches its health check to every group it makes; what Python can read of
    it (``_has_hooks``) answers alike for both."""
    if not hasattr(C10D, "HealthCheckHook"):
        pytest.skip("this torch has no health check")
    assert all(o[0] == "ok" for o in _alike(job, "hooks"))


def test_monitored_barrier(job: Any) -> None:
    if VERSION < (2, 14):
        pytest.skip("torch before 2.14 runs monitored_barrier on gloo only")
    assert _alike(job, "monitored_barrier") == [("ok", None)] * 2


def test_gather_single_as_gloo(job: Any) -> None:
    """gloo refuses it ("Backend gloo does not support gather_single"); so does rankwise,
    in the same words."""
    _alike(job, "gather_single")


def test_split_group(job: Any) -> None:
    """2.15 splits a CPU group. Before it, torch splits only where the default group is
    bound to a device, and a CPU ``device_id`` is refused: it refuses "rankwise" with
    gloo's words (seen on 2.11-2.14)."""
    if VERSION < (2, 15):
        assert all(o[0] == "error" for o in _alike(job, "split_group"))
        return
    per_rank, _ = job
    for out in per_rank:
        assert out["rankwise"]["split_group"] == ("ok", ("rankwise", [1.0]))
        assert out["gloo"]["split_group"] == ("ok", ("gloo", [1.0]))


def test_new_group_through_the_default_group(job: Any) -> None:
    assert _alike(job, "new_group") == [("ok", [2.0])] * 2


def test_set_timeout(job: Any) -> None:
    outcomes = _alike(job, "set_timeout")
    assert outcomes == [("ok", "raised within 10 s"), ("ok", "waited")]


def test_flight_recorder_records_and_fr_trace_reads(job: Any) -> None:
    if VERSION < (2, 15):
        pytest.skip("torch before 2.15 records gloo and NCCL groups only")
    assert _alike(job, "recorded") == [("ok", True)] * 2
    _, dumps = job
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                           str(dumps)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_store_view_clones_through_torch() -> None:
    """gloo's ``split_group`` under ``rankwise run`` clones the group's store in C++."""
    from rankwise.store.hash import HashStore
    from rankwise.store.torch_views import TorchStoreView

    if not hasattr(tdist.Store, "clone"):
        pytest.skip("this torch's Store has no clone")
    view = TorchStoreView(HashStore())
    twin = tdist.PrefixStore("p", view).clone()  # through torch's C++
    twin.set("k", b"v")
    assert view.check(["p/k"]) and view.get("p/k") == b"v"


def test_entry_point_without_importing_rankwise(tmp_path: Path) -> None:
    """torch 2.14+ loads backend "rankwise" from the ``torch.distributed.backends`` entry
    point: a process that never imports rankwise initializes it."""
    from importlib.metadata import entry_points

    if VERSION < (2, 14):
        pytest.skip("torch before 2.14 reads no backend entry points")
    if not any(e.name == "rankwise" for e in entry_points(group="torch.distributed.backends")):
        pytest.skip("rankwise is not installed with its entry points here")
    code = ("import sys, torch, torch.distributed as d\n"
            "ok = d.is_backend_available('rankwise')\n"
            "d.init_process_group('rankwise', store=d.HashStore(), rank=0, world_size=1)\n"
            "t = torch.ones(1); d.all_reduce(t)\n"
            "print('RESULT', ok, t.tolist(), d.get_backend())\n"
            "d.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = SRC  # this worktree's rankwise, found only through the entry point
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False, env=env, cwd=tmp_path)
    assert "RESULT True [1.0] rankwise" in proc.stdout, proc.stdout + proc.stderr[-3000:]
