"""A kept view's all_reduce on a device engine, through the one call path
(``api.path.launch``, ``api.plans``): its results, history, mismatch and timeout messages,
and the states a call may meet (a stale route, a queued call, a profiler). In-process: two thread-ranks whose default group's device
engine is the NCCL engine's gloo stand-in, CPU tensors on the tensor path."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any, ClassVar

import pytest

from rankwise.core.work import Work
from rankwise.errors import CollectiveMismatch

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.torch,
    # two thread-ranks making their first gloo collective at once in one process: seen to
    # segfault inside torch 2.11's ProcessGroupGloo (1 run in 6); real ranks are processes
    pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
                       reason="torch < 2.13: gloo thread-rank stand-in seen to segfault"),
]


def _on_device_plane(monkeypatch: pytest.MonkeyPatch, fn: Any,
                     op_timeout: float = 5.0) -> list[Any]:
    """``fn(rank)`` on two thread-ranks whose default group has the stand-in's device
    plane."""
    from rankwise.api.world import resolve_group
    from rankwise.engines.device.pair import DevicePair
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.nccl import STAND_IN, first_collective
    from rankwise.engines.torch.streams import HostStreams
    from rankwise.engines.torch.tensors import DeviceTensors
    from rankwise.store.hash import HashStore
    from rankwise.testing.threads import run_threads
    from rankwise.wire import device

    monkeypatch.setattr(device, "CPU_TENSORS", True)
    store = HashStore()

    def body(rank: int, size: int) -> Any:
        g = resolve_group(None)
        assert g is not None
        engine = TorchEngine.create(g, store, 10.0, prefix="device", name=STAND_IN,
                                    tensors=DeviceTensors(torch.device("cpu")),
                                    streams=HostStreams())
        first_collective(engine, 10.0)
        g.engine = DevicePair(g.engine, engine)  # type: ignore[arg-type]
        try:
            return fn(rank)
        finally:
            engine.close()
    return run_threads(body, 2, timeout=30.0, op_timeout=op_timeout)


def _steps(rank: int) -> Any:
    import rankwise as dist
    from rankwise.api.world import resolve_group

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # the plan's first call makes its fingerprint and route
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # int16: the engine reduces it widened and writes it back
    w = torch.full((2,), rank + 1, dtype=torch.int16)
    dist.all_reduce(w)
    dist.all_reduce(w)
    g = resolve_group(None)
    assert g is not None
    calls = [(c.seq, c.fp, c.site.short, c.shape) for c in g.recent(6)]
    return t.tolist(), w.tolist(), calls, work.description, work.result()[0].tolist()


def test_a_kept_views_device_calls_give_their_results_and_records(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got = _on_device_plane(monkeypatch, _steps)
    for rank in (0, 1):
        assert got[rank][0] == [12.0] * 3
        assert got[rank][1] == [6, 6]
        assert got[rank][4] == [12.0] * 3
        assert "all_reduce" in got[rank][3]
    assert got[0][2] == got[1][2]  # the same calls, sites and shapes on both ranks


def _mismatch(rank: int) -> str:
    import rankwise as dist

    t = torch.ones(2)
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.MAX)
    for op in ops:  # both plans warm on both ranks
        dist.all_reduce(t, op=op)
        dist.all_reduce(t, op=op)
    try:
        dist.all_reduce(t, op=ops[rank])
    except CollectiveMismatch as exc:
        return str(exc)
    raise AssertionError("no mismatch")


def test_a_mismatch_of_kept_views_names_both_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    said = _on_device_plane(monkeypatch, _mismatch)
    for s in said:
        assert "called all_reduce(float32 x 2, op=SUM) on CUDA at test_device_fast_path.py:" \
            in s
        assert "op=MAX) on CUDA at test_device_fast_path.py:" in s.split("\n")[0]
    assert _stable(said[0]) == _stable(said[1])


def _stable(message: str) -> str:
    """A mismatch report from its diverging calls to the recent history (the rest names
    whichever rank saw it first, and what the other does by then)."""
    return message[message.index("Where the ranks diverged"):
                   message.index("Where each rank is now")]


def _states(rank: int) -> list[Any]:
    import rankwise as dist
    from rankwise.api.world import resolve_group

    g = resolve_group(None)
    assert g is not None
    t = torch.ones(2)
    dist.all_reduce(t)
    engine = g.engine
    g.engine = type(engine)(engine.host, engine.device)  # type: ignore[attr-defined]
    dist.all_reduce(t)  # the route is stale: the call makes the new one
    seen: list[Any] = [g.device_route is not None and g.device_route[0] is g.engine]
    queued = g.queued = Work("a queued call")
    queued._finish()
    dist.all_reduce(t)  # an async call is queued: waited for first
    seen.append(g.queued is None)
    _recording.on = True
    try:
        dist.all_reduce(t)  # a profiler records: the call has its event
    finally:
        _recording.on = False
    seen.append(_Event.made.get(rank, 0))
    u = torch.ones(2, 2)
    dist.all_reduce(u.view(4))  # another view of the same storage
    seen.append(t.tolist())
    seen.append(u.tolist())
    return seen


class _Recording(threading.local):
    """Per thread-rank: a (stand-in) profiler records now."""

    on = False


_recording = _Recording()


class _Event:
    """A stand-in profiler event (``api.profiling.Event``), counted per thread-rank."""

    made: ClassVar[dict[int, int]] = {}

    def __init__(self, op: str, inputs: Any) -> None:
        from rankwise.api.world import resolve_group

        g = resolve_group(None)
        assert g is not None
        _Event.made[g.group_rank] = _Event.made.get(g.group_rank, 0) + 1

    def end(self) -> None:
        pass


def test_each_state_a_call_meets_gives_the_same_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.api import profiling

    monkeypatch.setattr(profiling, "on", lambda: _recording.on)
    monkeypatch.setattr(profiling, "recording", lambda: _recording.on)
    monkeypatch.setattr(profiling, "Event", _Event)
    monkeypatch.setattr(_Event, "made", {})
    for seen in _on_device_plane(monkeypatch, _states):
        assert seen == [True, True, 1, [16.0, 16.0], [[2.0, 2.0], [2.0, 2.0]]]


def _timeout(rank: int, left: Any) -> str:
    import rankwise as dist
    from rankwise.errors import DistTimeout

    t = torch.ones(2)
    dist.all_reduce(t)
    dist.all_reduce(t)
    if rank == 1:  # never makes the third call: rank 0's ends at its deadline
        assert left.wait(30.0)
        return ""
    try:
        dist.all_reduce(t)
    except DistTimeout as exc:
        return str(exc)
    finally:
        left.set()
    raise AssertionError("no timeout")


def test_a_timeout_of_a_kept_view_names_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    said = _on_device_plane(monkeypatch, partial(_timeout, left=threading.Event()),
                            op_timeout=1.0)[0]
    assert "rank 0 timed out after 1s in all_reduce(float32 x 2, op=SUM) on CUDA at " \
        "test_device_fast_path.py:" in said
