"""The device hot path's steps in C (``rankwise._hotcall``) against the same steps in
Python: one thread-rank over a fake torch group and CUDA streams runs the same program
each way (``in_c``), and the records, who-is-where, traces, ``Work``s and errors it
leaves must be the same, field by field. Also the engine's C part alone, called from
the Python steps (``_device_all_reduce`` with the API's C part off)."""

from __future__ import annotations

from typing import Any

import pytest
from _device_fakes import fake_cuda_streams

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


class _Work:
    def __init__(self, fail: list[BaseException]) -> None:
        self.fail = fail

    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        if self.fail:
            raise self.fail.pop()
        return True

    def abort(self) -> None:
        pass


class _Group:
    """A ``ProcessGroupNCCL`` of one rank; ``fail_wait`` / ``fail_enqueue``: the next
    work's ``wait()`` or the next ``allreduce`` raises that."""

    def __init__(self) -> None:
        self.fail_wait: list[BaseException] = []
        self.fail_enqueue: list[BaseException] = []
        self.calls = 0

    def allreduce(self, tensors: list[Any], opts: Any = None) -> _Work:
        self.calls += 1
        if self.fail_enqueue:
            raise self.fail_enqueue.pop()
        return _Work(self.fail_wait)

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _Tracer:
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def collective(self, group: Any, call: Any) -> None:
        self.seen.append((group.id, call.seq))


def _run(monkeypatch: pytest.MonkeyPatch, program: Any) -> Any:
    """``program(dist, group, pg, t)`` on one thread-rank whose default group's device
    engine is the NCCL engine over ``_Group``; CPU tensors take the device path."""
    import rankwise as dist
    from rankwise.api.world import resolve_group
    from rankwise.engines.base import check_mode
    from rankwise.engines.device.pair import DevicePair
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.tensors import DeviceTensors
    from rankwise.testing.threads import run_threads
    from rankwise.wire import device

    monkeypatch.setattr(device, "CPU_TENSORS", True)

    def body(rank: int, size: int) -> Any:
        group = resolve_group(None)
        assert group is not None
        pg = _Group()
        engine = TorchEngine(group, pg, check_mode(), name="nccl",
                             tensors=DeviceTensors(torch.device("cpu")), streams=fake_cuda_streams())
        group.engine = DevicePair(group.engine, engine)  # type: ignore[arg-type]
        try:
            return program(dist, group, pg, torch.ones(2))
        finally:
            engine.close()

    return run_threads(body, 1, timeout=60.0, op_timeout=10.0)[0]


def _bound(t: Any) -> Any:
    from rankwise.api import collectives

    return next(iter(collectives.tensor_view(t)[1].values())).bound


def _records(dist: Any, group: Any, pg: Any, t: Any) -> Any:
    tracer = _Tracer()
    group.comm.tracer = tracer
    dist.all_reduce(t)  # binds the plan
    for _ in range(2):
        dist.all_reduce(t)
    with dist.record_comm("step"):
        dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    described = work.description
    assert work.wait() and work.is_completed()
    with dist.record_comm("later"):
        labelled = dist.all_reduce(t, async_op=True)
    assert labelled is not None
    calls = group.recent(6)
    idle = group.comm.activity
    fields = [(c.seq, c.fp, c.site.short, c.dtype, c.op, c.shape, c.label, c.engine,
               c.enqueued == c.started, c.finished >= c.started > 0,
               round(c.deadline - group.timeout - (c.finished - c.started), 0) > 0)
              for c in calls]
    return {"fields": fields, "result": t.tolist(), "described": described,
            "labelled": labelled.description,
            "futures": labelled.get_future().wait()[0].tolist(),
            "idle": (idle.op, idle.since == calls[-1].finished),
            "last": group.comm.calls._last.seq,
            "traced": tracer.seen[-6:] == [(group.id, c.seq) for c in calls],
            "enqueued": pg.calls, "bound": _bound(t)[4] is not None}


def _both_ways(monkeypatch: pytest.MonkeyPatch, program: Any) -> tuple[Any, Any]:
    """``program``'s outcome with the hot path's steps in Python, then in C."""
    from rankwise.api import collectives
    from rankwise.engines.torch import engine, streams

    if collectives._CAllReduce is None:
        pytest.skip("rankwise._hotcall was not built (no compiler at install time)")
    seen = []
    for in_c in (False, True):
        monkeypatch.setattr(collectives, "hot_in_c", in_c)
        monkeypatch.setattr(engine, "hot_in_c", in_c)
        monkeypatch.setattr(streams, "order_in_c", in_c)
        seen.append(_run(monkeypatch, program))
    return seen[0], seen[1]


def test_the_c_steps_leave_the_python_steps_records(monkeypatch: pytest.MonkeyPatch) -> None:
    in_python, in_c = _both_ways(monkeypatch, _records)
    assert in_python.pop("bound") is False and in_c.pop("bound") is True
    assert in_c["traced"] and in_c["enqueued"] == 6
    assert [f[6] for f in in_c["fields"]] == [None, None, None, "step", None, "later"]
    assert in_c["labelled"].startswith("later #6 on ")
    assert in_c == in_python  # field by field


def test_the_engines_c_part_serves_the_python_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.api import collectives
    from rankwise.engines.torch import engine

    if engine.Enqueue is None:
        pytest.skip("rankwise._hotcall was not built (no compiler at install time)")
    monkeypatch.setattr(collectives, "hot_in_c", False)
    monkeypatch.setattr(engine, "hot_in_c", True)
    seen = _run(monkeypatch, _records)
    assert seen.pop("bound") is False
    monkeypatch.setattr(engine, "hot_in_c", False)
    other = _run(monkeypatch, _records)
    other.pop("bound")
    assert seen == other


def _errors(dist: Any, group: Any, pg: Any, t: Any) -> Any:
    from rankwise.errors import DistError

    def outcome(fn: Any) -> Any:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - compared
            activity = group.comm.activity
            return (type(exc).__name__, str(exc).split("\n")[0], exc.__cause__,
                    exc.__suppress_context__, type(exc.__context__).__name__,
                    activity.op, group.comm.calls._last.seq)
        return None

    dist.all_reduce(t)
    dist.all_reduce(t)
    said = []
    pg.fail_wait.append(RuntimeError("NCCL error: unhandled cuda error"))
    said.append(outcome(lambda: dist.all_reduce(t)))  # the op's own error, explained
    pg.fail_wait.append(DistError("the watchdog's verdict"))
    said.append(outcome(lambda: dist.all_reduce(t)))  # as it is
    pg.fail_enqueue.append(ValueError("bad enqueue"))
    said.append(outcome(lambda: dist.all_reduce(t)))  # as it is, the call ended
    pg.fail_enqueue.append(ValueError("bad async enqueue"))
    work = dist.all_reduce(t, async_op=True)  # the Work holds it
    said.append(outcome(lambda: work.wait()))
    watchdog = group.engine.device.device.watchdog
    watchdog.failed = DistError("aborted before")
    said.append(outcome(lambda: dist.all_reduce(t)))  # every later call raises it
    return said, group.seq


def test_the_c_steps_raise_what_the_python_steps_raise(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    in_python, in_c = _both_ways(monkeypatch, _errors)
    said, _ = in_c
    op_error, verdict, enqueue, in_work, aborted = said
    assert op_error[2] is None and op_error[3]  # ``raise ... from None``
    assert op_error[4] == "RuntimeError" and "unhandled cuda error" in op_error[1]
    assert verdict[:2] == ("DistError", "the watchdog's verdict")
    assert enqueue[:2] == ("ValueError", "bad enqueue")
    assert in_work[:2] == ("ValueError", "bad async enqueue")
    assert aborted[:2] == ("DistError", "aborted before")
    assert all(s[5] == "" for s in said)  # back in user code after each
    assert in_c == in_python


def _known_failure(dist: Any, group: Any, pg: Any, t: Any) -> Any:
    from rankwise.errors import PeerFailure

    dist.all_reduce(t)
    dist.all_reduce(t)
    router = group.comm.router
    router.failure = PeerFailure("rank 1 is gone", rank=1)
    before = group.seq
    try:
        dist.all_reduce(t)
    except PeerFailure as exc:
        return str(exc), group.seq - before, pg.calls
    finally:
        router.failure = None
    raise AssertionError("no failure")


def test_a_failure_known_before_the_call_is_begins_to_raise(monkeypatch: pytest.MonkeyPatch,
                                                           in_c: bool) -> None:
    said, taken, enqueued = _run(monkeypatch, _known_failure)
    assert "rank 1 is gone" in said and taken == 0 and enqueued == 2


def _front_guard(dist: Any, group: Any, pg: Any, t: Any) -> Any:
    import numpy as np

    from rankwise.api import collectives, profiling

    front = collectives._front
    total = dist.ReduceOp.SUM
    dist.all_reduce(t)  # binds the plan
    said: dict[str, Any] = {"warm": front(t, total, None, False)}
    work = front(t, total, None, True)
    said["async"] = type(work).__name__, work.wait()
    seq = group.seq
    said["a group named"] = front(t, total, group, False)
    said["no plan for the op"] = front(t, dist.ReduceOp.MAX, None, False)
    said["an array"] = front(np.ones(2, dtype=np.float32), total, None, False)
    said["a subclass"] = front(torch.nn.Parameter(t.clone(), requires_grad=False), total,
                               None, False)
    t.requires_grad_(True)
    said["requires grad"] = front(t, total, None, False)
    t.requires_grad_(False)
    group.queued, queued = collectives.Work("a queued call"), group.queued
    said["a call queued"] = front(t, total, None, False)
    group.queued = queued
    recording, on = profiling.recording, profiling.on
    profiling.recording = profiling.on = lambda: True
    try:
        said["a profiler records"] = front(t, total, None, False)
    finally:
        profiling.recording, profiling.on = recording, on
    route, group.device_route = group.device_route, None
    said["another route"] = front(t, total, None, False)
    group.device_route = route
    said["not taken"] = group.seq - seq
    t.resize_(3)
    said["resized"] = front(t, total, None, False)
    return said


def test_the_c_checks_take_only_what_the_python_checks_take(
        monkeypatch: pytest.MonkeyPatch, in_c: bool) -> None:
    from rankwise.api import collectives

    if not in_c:  # the Python steps: no plan is bound to C steps, the front takes none
        said = _run(monkeypatch, lambda dist, group, pg, t: (
            dist.all_reduce(t), collectives._front(t, dist.ReduceOp.SUM, None, False))[1])
        assert said is NotImplemented or collectives._front is None
        return
    said = _run(monkeypatch, _front_guard)
    assert said.pop("warm") is None and said.pop("async") == ("_Ended", True)
    assert said.pop("not taken") == 0
    assert said == dict.fromkeys(said, NotImplemented)
    assert len(said) == 9
