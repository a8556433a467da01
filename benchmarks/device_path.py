"""The device path's host cost per call, without a GPU: rankwise's NCCL engine over a fake
``ProcessGroupNCCL`` whose works, events and streams cost CPU time as real ones do.

    python benchmarks/device_path.py [--calls N] [--repeats R]

Why a proxy: the host time of a 4-byte NCCL all_reduce is almost all Python and driver
calls (kernel launch, event record, stream wait, event query), so a fake that burns the
CPU time of each of those calls, where a real one would, shows what rankwise's own
bookkeeping adds, on any machine. The fake's costs (``COSTS``, microseconds of busy CPU)
are set so that its own blocking call costs about what torch's did on an H200
(15.5-28 us, docs/gpu.md); the kernel "runs" ``KERNEL_US`` after its launch (an event
query says done from then on).

What runs: one thread-rank (world size 1, memory transport) whose default group's device
engine is rankwise's ``TorchEngine`` with the real ``CudaStreams`` over the fake CUDA
and the fake group, exactly the engine ``engines.nccl`` builds on a GPU; CPU tensors
take the device path (``wire.device.CPU_TENSORS``). Each round times ``--calls``
``all_reduce`` calls of one float32, blocking and ``async_op=True`` then ``wait()``,
through rankwise's public API and on the fake group alone (``allreduce`` then
``wait()``: torch's own blocking call), alternated; per call, the calling thread's CPU
time (``time.thread_time``) and every thread's (``time.process_time``: the watchdog's
and the async worker's too). The last line is the worse of the two kinds, each the
median over rounds:

    device path per call: caller CPU 1.23x, all threads 1.45x the fake's
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

#: busy CPU microseconds of each fake CUDA/NCCL call (what the real call costs the host)
COSTS = {
    "enqueue": 12.0,  #: ProcessGroupNCCL.allreduce: c10d's checks, the kernel launch, its events
    "work_wait": 2.0,  #: WorkNCCL.wait(): cudaStreamWaitEvent on the current stream
    "is_completed": 0.8,  #: WorkNCCL.isCompleted(): cudaEventQuery of its end event
    "record": 1.5,  #: torch.cuda.Event() + record(): cudaEventRecord
    "query": 0.8,  #: Event.query(): cudaEventQuery
    "stream_wait": 1.5,  #: Stream.wait_event: cudaStreamWaitEvent
    "current_stream": 0.3,  #: torch.cuda.current_stream(): a Python stream object
    "use_stream": 0.6,  #: torch.cuda.stream(s) entered and left
}
#: microseconds after its launch at which the fake kernel is done
KERNEL_US = 15.0


def _spin(us: float) -> None:
    """Burn ``us`` microseconds of this thread's CPU (what a driver call would): CPU
    time, not wall time, so that a thread descheduled mid-call (a loaded machine) still
    pays the whole cost."""
    if us <= 0:
        return
    clock = time.thread_time
    end = clock() + us * 1e-6
    while clock() < end:
        pass


class FakeEvent:
    def __init__(self) -> None:
        self.ready = 0.0

    def record(self, stream: Any = None) -> None:
        _spin(COSTS["record"])
        self.ready = time.perf_counter() + KERNEL_US * 1e-6

    def query(self) -> bool:
        _spin(COSTS["query"])
        return time.perf_counter() >= self.ready

    def synchronize(self) -> None:
        while time.perf_counter() < self.ready:
            pass


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.device = device

    def wait_event(self, event: Any) -> None:
        _spin(COSTS["stream_wait"])

    def wait_stream(self, other: Any) -> None:  # torch: record an event, wait for it
        _spin(COSTS["record"] + COSTS["stream_wait"])

    def query(self) -> bool:
        return True


_DEFAULT = FakeStream()


def fake_torch() -> Any:
    """What ``CudaStreams`` uses of ``torch``: ``torch.cuda``'s streams and events."""
    current = [_DEFAULT]

    def current_stream(device: Any = None) -> FakeStream:
        _spin(COSTS["current_stream"])
        return current[0]

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        _spin(COSTS["use_stream"])
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    cuda = SimpleNamespace(current_stream=current_stream, Stream=FakeStream, stream=stream,
                           Event=FakeEvent)
    return SimpleNamespace(cuda=cuda)


class FakeWork:
    """A ``WorkNCCL``: its end event recorded at enqueue; ``wait`` is a stream wait.
    Taken from a pool, not made per call: torch's works are C++ objects that Python's
    garbage collector does not track, and a Python object it tracks would make the
    collector's passes cost rankwise (which keeps each work until its kernel is done)
    what they never cost with torch's (docs/gpu.md, "The fake's works")."""

    __slots__ = ("ready",)

    def __init__(self) -> None:
        self.ready = 0.0

    def is_completed(self) -> bool:
        _spin(COSTS["is_completed"])
        return time.perf_counter() >= self.ready

    def wait(self, *args: Any) -> bool:
        _spin(COSTS["work_wait"])
        return True

    def abort(self) -> None:
        pass


#: works in the pool: a work is handed out again after this many calls, long after
#: rankwise dropped its record of it (at most ``HEARTBEAT``, 0.1 s, after its kernel)
POOL = 1 << 16


def _untracked_pool() -> list[FakeWork]:
    """``POOL`` works the garbage collector does not track (as torch's C++ works)."""
    import ctypes

    untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    untrack.argtypes = [ctypes.py_object]
    pool = [FakeWork() for _ in range(POOL)]
    for w in pool:
        untrack(w)  # its one slot holds a float: it is in no cycle
    return pool


class FakeNccl:
    """A ``ProcessGroupNCCL`` of one rank: every collective costs ``enqueue``."""

    def __init__(self) -> None:
        self._pool = _untracked_pool()
        self._next = 0

    def allreduce(self, tensors: list[Any], opts: Any = None) -> FakeWork:
        _spin(COSTS["enqueue"])
        i = self._next
        self._next = (i + 1) % POOL
        work = self._pool[i]
        work.ready = time.perf_counter() + KERNEL_US * 1e-6
        return work

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _per_call(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """(caller CPU, all threads' CPU) seconds per call of ``fn``."""
    for _ in range(min(calls, 200)):  # warm
        fn()
    t0, p0 = time.thread_time(), time.process_time()
    for _ in range(calls):
        fn()
    t1, p1 = time.thread_time(), time.process_time()
    return (t1 - t0) / calls, (p1 - p0) / calls


def _measure(calls: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    import torch

    import rankwise as dist
    from rankwise.api.world import resolve_group
    from rankwise.engines.base import check_mode
    from rankwise.engines.device.pair import DevicePair
    from rankwise.engines.torch.engine import _ALLREDUCE_OPTS, TorchEngine
    from rankwise.engines.torch.streams import CudaStreams
    from rankwise.engines.torch.tensors import DeviceTensors
    from rankwise.testing.threads import run_threads
    from rankwise.wire import device

    device.CPU_TENSORS = True

    def body(rank: int, size: int) -> dict[str, dict[str, list[float]]]:
        group = resolve_group(None)
        assert group is not None
        streams = CudaStreams(torch.device("cpu"))
        streams.torch = fake_torch()
        pg = FakeNccl()
        engine = TorchEngine(group, pg, check_mode(), name="nccl",
                             tensors=DeviceTensors(torch.device("cpu")), streams=streams)
        group.engine = DevicePair(group.engine, engine)  # type: ignore[arg-type]
        t = torch.ones(1)
        opts = _ALLREDUCE_OPTS["SUM"]

        def rw_blocking() -> None:
            dist.all_reduce(t)

        def rw_async() -> None:
            work = dist.all_reduce(t, async_op=True)
            assert work is not None
            work.wait()

        def fake_call() -> None:
            pg.allreduce([t], opts).wait()

        out: dict[str, dict[str, list[float]]] = {
            k: {"rankwise": [], "fake": [], "rankwise_all": [], "fake_all": []}
            for k in ("blocking", "async")}
        try:
            for _ in range(repeats):
                for kind, rw in (("blocking", rw_blocking), ("async", rw_async)):
                    for who, fn in (("rankwise", rw), ("fake", fake_call)):
                        caller, every = _per_call(fn, calls)
                        out[kind][who].append(caller)
                        out[kind][f"{who}_all"].append(every)
            dist.barrier()
        finally:
            engine.close()
        return out

    return run_threads(body, 1, timeout=600.0, op_timeout=30.0)[0]


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:6.1f} us ({min(xs) * 1e6:.1f}-{max(xs) * 1e6:.1f})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    results = _measure(args.calls, args.repeats)
    worst_caller = worst_all = 0.0
    print(f"{args.calls} calls x {args.repeats} rounds, alternated; per call, median "
          "(min-max) over rounds")
    for kind, r in results.items():
        caller = [a / b for a, b in zip(r["rankwise"], r["fake"], strict=True)]
        every = [a / b for a, b in zip(r["rankwise_all"], r["fake_all"], strict=True)]
        print(f"{kind:<8} caller CPU: rankwise {_us(r['rankwise'])}, fake {_us(r['fake'])}: "
              f"{statistics.median(caller):.2f}x ({min(caller):.2f}-{max(caller):.2f})")
        print(f"{'':<8} all threads: rankwise {_us(r['rankwise_all'])}, fake "
              f"{_us(r['fake_all'])}: {statistics.median(every):.2f}x "
              f"({min(every):.2f}-{max(every):.2f})")
        worst_caller = max(worst_caller, statistics.median(caller))
        worst_all = max(worst_all, statistics.median(every))
    # the machine's state: the fake's spins cost the same CPU time on a busy or slow
    # machine, its Python (and rankwise's, far larger) does not: compare runs whose fake
    # overhead is alike (docs/gpu.md: 2.6-2.8 us idle and fast, ~5 us in a slow state)
    fake = statistics.median(x for r in results.values() for x in r["fake"]) * 1e6
    busy = COSTS["enqueue"] + COSTS["work_wait"]
    print(f"machine state: the fake's call {fake:.1f} us, {busy:.1f} of them busy spins; "
          f"its Python and clock reads {fake - busy:.1f} us")
    print(f"device path per call: caller CPU {worst_caller:.2f}x, all threads "
          f"{worst_all:.2f}x the fake's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
