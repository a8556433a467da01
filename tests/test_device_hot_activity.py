"""Who-is-where on the device engine's path (``api.path``, ``TorchEngine``): a report
made while the kernel is in flight names the call, its line and the engine holding it;
after the call the rank is back in user code. One thread-rank over a fake torch group."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from _device_fakes import fake_cuda_streams

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


class _Work:
    def __init__(self, seen: list[Any], comm: Any) -> None:
        self.seen, self.comm = seen, comm

    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:  # the caller's stream ordered after the kernel
        self.seen.append(self.comm.activity)  # a report made now, as a peer would ask
        return True

    def abort(self) -> None:
        pass


class _Group:
    def __init__(self, seen: list[Any], comm: Any) -> None:
        self.seen, self.comm = seen, comm

    def allreduce(self, tensors: list[Any], opts: Any = None) -> _Work:
        return _Work(self.seen, self.comm)

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_a_report_during_a_device_call_names_it_and_after_it_user_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise as dist
    from rankwise.api.world import resolve_group
    from rankwise.engines.base import check_mode
    from rankwise.engines.device.pair import DevicePair
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.tensors import DeviceTensors
    from rankwise.testing.threads import run_threads
    from rankwise.wire import device

    monkeypatch.setattr(device, "CPU_TENSORS", True)

    def body(rank: int, size: int) -> tuple[list[Any], Any, int]:
        group = resolve_group(None)
        assert group is not None
        seen: list[Any] = []
        engine = TorchEngine(group, _Group(seen, group.comm), check_mode(), name="nccl",
                             tensors=DeviceTensors(torch.device("cpu")), streams=fake_cuda_streams())
        group.engine = DevicePair(group.engine, engine)  # type: ignore[arg-type]
        t = torch.ones(2)
        try:
            line = sys._getframe().f_lineno + 2  # the all_reduce's line
            for _ in range(3):
                dist.all_reduce(t)
            dist.all_reduce(t, async_op=True).wait()  # waited after the call ended
            return seen, group.comm.activity, line
        finally:
            engine.close()

    seen, after, line = run_threads(body, 1, timeout=60.0, op_timeout=10.0)[0]
    during = seen[1:3]
    assert [a.op for a in during] == ["all_reduce", "all_reduce"]
    assert during[1].seq == during[0].seq + 1
    assert all(a.engine == "nccl" and a.enqueued > 0 for a in during)
    assert all(a.site.frames[0][1] == line and a.since > 0 for a in during)
    assert not seen[3].op  # an async call's work waited after it: user code again
    assert not after.op and after.since >= during[1].since
