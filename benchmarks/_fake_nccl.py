"""The device path without a GPU, for ``device_path.py``: a ``ProcessGroupNCCL`` stand-in
and ``torch.cuda`` streams and events that cost nothing, under rankwise's NCCL engine.

Why costs of zero: whatever the benchmark then times on the calling thread is rankwise's
own bookkeeping (and the few Python calls into these fakes), not a model of the driver.
Why works from an untracked pool: torch's works are C++ objects that Python's garbage
collector does not see; a tracked Python object per call would make the collector's
passes cost rankwise (which keeps each work until its kernel is done) what they never
cost with torch's.

``install()`` is the one place here that knows rankwise's internals: it builds the
engine ``engines.torch.nccl.create_device_engine`` builds on a GPU (``TorchEngine`` with
``DeviceTensors`` and the real ``CudaStreams``) over these fakes, and pairs it with the
default group's host engine, as ``tests/test_device_hot_activity.py`` does. Everything
the benchmark times goes through rankwise's public API or torch's.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

__all__ = ["FakeNccl", "install"]


class _Stream:
    """A CUDA stream whose waits are free (nothing runs on it)."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    """A CUDA event that is done when recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _fake_cuda() -> Any:
    """What ``CudaStreams`` uses of ``torch``: ``torch.cuda``'s streams and events."""
    current = [_Stream()]

    def current_stream(device: Any = None) -> _Stream:
        return current[0]

    @contextlib.contextmanager
    def stream(s: _Stream) -> Iterator[None]:
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    return SimpleNamespace(cuda=SimpleNamespace(current_stream=current_stream, Stream=_Stream,
                                                stream=stream, Event=_Event))


class _Work:
    """A ``WorkNCCL`` whose kernel is done at once: ``wait`` is a (free) stream wait."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = True

    def is_completed(self) -> bool:
        return self.done

    def wait(self, *args: Any) -> bool:
        return True

    def abort(self) -> None:
        pass


#: works in the pool: one is handed out again this many calls later, long after rankwise
#: dropped its record of it
POOL = 1 << 16


class FakeNccl:
    """A ``ProcessGroupNCCL`` of any size whose collectives cost nothing and move nothing
    (every rank calls it alike, so the results are never read)."""

    def __init__(self) -> None:
        untrack = ctypes.pythonapi.PyObject_GC_UnTrack
        untrack.argtypes = [ctypes.py_object]
        self._pool = [_Work() for _ in range(POOL)]
        for w in self._pool:
            untrack(w)  # its one slot holds a bool: it is in no cycle
        self._next = 0
        #: collectives asked of it (the benchmark checks that its calls came here)
        self.calls = 0

    def _work(self) -> _Work:
        self.calls += 1
        i = self._next
        self._next = (i + 1) % POOL
        return self._pool[i]

    def allreduce(self, tensors: list[Any], opts: Any = None) -> _Work:
        return self._work()

    def barrier(self, opts: Any = None) -> _Work:
        return self._work()

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def install() -> FakeNccl:
    """Give the default group a device engine over ``FakeNccl`` (CPU tensors take the
    device path from now on). Call after ``init_process_group``, on every rank; the
    group's ``destroy_process_group`` closes it as it would NCCL's."""
    import torch

    from rankwise.api.world import resolve_group
    from rankwise.engines.base import check_mode
    from rankwise.engines.device.pair import DevicePair
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.streams import CudaStreams
    from rankwise.engines.torch.tensors import DeviceTensors
    from rankwise.wire import device

    group = resolve_group(None)
    if group is None:
        raise RuntimeError("install() needs rankwise initialized on this rank")
    cpu = torch.device("cpu")
    streams = CudaStreams(cpu)
    streams.torch = _fake_cuda()
    pg = FakeNccl()
    engine = TorchEngine(group, pg, check_mode(), name="nccl", tensors=DeviceTensors(cpu),
                         streams=streams)
    group.engine = DevicePair(group.engine, engine)
    device.CPU_TENSORS = True
    return pg
