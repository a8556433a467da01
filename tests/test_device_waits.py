"""Issue 28: the NCCL engine's waits without a host sync, in-process, with fakes.

A fake torch work whose event never completes, a fake clock and fake streams stand in
for the GPU: ``wait()`` must return while the kernel still runs (the current stream is
ordered after it instead), the book must abort the group and settle the work with
the error past the deadline (or on a control-plane failure), async calls must be
enqueued on a side stream that follows the caller's and be waited for on the waiter's
stream, and ``Work.is_completed``/``get_future`` must follow the kernels, as torch's.
No thread is needed but where the ledger's own thread is the point; no sleeps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from rankwise.core.work import Work
from rankwise.engines.torch.device_waits import DeviceWaits, DeviceWork, current_holder
from rankwise.engines.torch.streams import CudaStreams, HostStreams, Streams
from rankwise.engines.torch.work_book import GRACE, WorkBook
from rankwise.errors import CollectiveMismatch, DistTimeout, InvalidArgument

torch = pytest.importorskip("torch")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeCall:
    deadline: float
    patient: bool = False
    quiet: bool = False
    inline: list[Any] | None = None  #: ``engines.base.Call.inline``

    def describe(self, site: bool = True) -> str:
        return "all_reduce(float32 x 4, op=SUM)"


@dataclass
class FakePlane:
    """The control plane: records what the book asked."""

    failed: BaseException | None = None
    busy: bool = False
    slowed: list[Any] = field(default_factory=list)
    warned: list[Any] = field(default_factory=list)
    probes: list[float] = field(default_factory=list)

    def failure(self) -> BaseException | None:
        return self.failed

    def slow(self, call: Any) -> bool:
        self.slowed.append(call)
        return not self.busy

    def warn_at(self, call: Any, start: float) -> float:
        return start + 10.0

    def warn(self, call: Any) -> None:
        self.warned.append(call)

    def probe_at(self, start: float) -> float:
        return start + 20.0

    def probe(self, blocked_for: float) -> float:
        self.probes.append(blocked_for)
        return 5.0

    def timed_out(self, call: Any) -> BaseException:
        return DistTimeout(f"timed out in {call.describe()}")

    def op_failed(self, call: Any, err: BaseException) -> BaseException:
        return DistTimeout(f"op failed: {err}")


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.log: list[tuple[str, Any]] = []

    def __repr__(self) -> str:
        return self.name


class FakeStreams(Streams):
    """CUDA-like streams: per-thread current stream, ops recorded, nothing blocks."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.default = FakeStream("default")
        self._side = FakeStream("side")
        self.events = 0

    def current(self) -> FakeStream:
        cur: FakeStream = getattr(self._local, "stream", self.default)
        return cur

    def side(self) -> FakeStream:
        return self._side

    def follow(self, stream: Any, other: Any) -> None:
        stream.log.append(("follows", other))

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        before = self.current()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def record(self, stream: Any) -> Any:
        self.events += 1
        event = ("event", self.events, stream)
        stream.log.append(("record", event))
        return event

    def wait_event(self, event: Any) -> None:
        if event is not None:
            self.current().log.append(("waits", event))

    def order(self, p: Any) -> None:
        CudaStreams.order(self, p)  # type: ignore[arg-type]  # the real ordering rule


class FakeWork:
    """A torch work whose 'CUDA event' completes only when the test says so;
    ``wait()`` is a stream wait (recorded), never a host block."""

    def __init__(self, streams: FakeStreams | None = None) -> None:
        self.completed = False
        self.error: RuntimeError | None = None
        self.streams = streams
        self.waits: list[Any] = []

    def is_completed(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.completed

    def wait(self, *args: Any) -> bool:
        assert not args, "a timed wait: NCCL's watchdog would tear the process down"
        self.waits.append(self.streams.current() if self.streams else None)
        return True


def _book(clock: Clock, plane: FakePlane | None = None) -> tuple[WorkBook, list[int]]:
    aborts: list[int] = []
    book = WorkBook(plane or FakePlane(), lambda: aborts.append(1), clock=clock)
    return book, aborts


# --- wait() returns before the kernel does; the book bounds it -------------------------

def test_wait_returns_before_the_event_completes_and_the_book_raises_past_the_deadline(
        ) -> None:
    clock = Clock()
    book, aborts = _book(clock)
    streams = FakeStreams()
    waits = DeviceWaits(book, streams, lambda c, e: e)
    work = FakeWork(streams)
    call = FakeCall(deadline=clock.now + 3.0)

    waits.wait(call, work)  # returns at once: the kernel has not finished
    assert work.waits == [streams.default], "the current stream must wait for the kernel"
    assert not work.completed and book.in_flight() == 1

    clock.now += 2.9
    book.tick()
    assert book.in_flight() == 1 and not aborts and book.failed is None
    waits.raise_failed()  # nothing to raise yet

    clock.now += 0.2  # past the deadline: abort the communicator, settle the work
    book.tick()
    assert aborts == [1] and book.in_flight() == 0
    assert isinstance(book.failed, DistTimeout) and "timed out in all_reduce" in str(book.failed)
    with pytest.raises(DistTimeout, match="timed out in all_reduce"):
        waits.raise_failed()  # the next call on the group
    later = FakeWork(streams)
    with pytest.raises(DistTimeout):
        waits.wait(FakeCall(deadline=clock.now + 3.0), later)  # settled with it at once
    book.tick()
    assert aborts == [1], "the group is aborted once"


def test_a_failure_on_the_control_plane_aborts_at_once() -> None:
    clock = Clock()
    plane = FakePlane()
    book, aborts = _book(clock, plane)
    p = book.watch(FakeCall(deadline=clock.now + 60.0), FakeWork())
    book.tick()
    assert not p.settled.is_set()
    plane.failed = CollectiveMismatch("rank 1 called all_reduce, rank 0 broadcast")
    book.tick()
    assert aborts == [1] and p.settled.is_set() and p.error is plane.failed


def test_finished_works_settle_and_slow_ones_send_the_check_batch() -> None:
    clock = Clock()
    plane = FakePlane(busy=True)
    book, aborts = _book(clock, plane)
    fast, slow = FakeWork(), FakeWork()
    pf = book.watch(FakeCall(deadline=clock.now + 60.0), fast)
    ps = book.watch(FakeCall(deadline=clock.now + 60.0), slow)
    fast.completed = True
    book.tick()
    assert pf.settled.is_set() and pf.error is None and book.in_flight() == 1
    assert plane.slowed == []  # within the grace period
    clock.now += 2 * GRACE
    book.tick()
    book.tick()
    assert plane.slowed == [ps.call, ps.call]  # the check was busy: asked again
    plane.busy = False
    book.tick()
    book.tick()
    assert len(plane.slowed) == 3, "sent once it could be"
    clock.now += 10.0
    book.tick()
    assert plane.warned == [ps.call]
    clock.now += 10.0
    book.tick()
    assert plane.probes and not aborts


def test_an_op_error_settles_with_the_planes_account() -> None:
    clock = Clock()
    book, aborts = _book(clock)
    work = FakeWork()
    p = book.watch(FakeCall(deadline=clock.now + 60.0), work)
    work.error = RuntimeError("NCCL error: remote process exited")
    book.tick()
    assert aborts == [1] and isinstance(p.error, DistTimeout)
    assert "remote process exited" in str(p.error)


def test_the_ledger_thread_aborts_past_the_deadline() -> None:
    """The same verdict from the ledger's own thread (it polls; the test only waits
    for the settlement event, bounded)."""
    clock = Clock()
    book, aborts = _book(clock)
    book.start()
    try:
        p = book.watch(FakeCall(deadline=clock.now + 1.0), FakeWork())
        clock.now += 2.0
        assert p.settled.wait(10.0), "the ledger never settled the work"
        assert isinstance(p.error, DistTimeout) and aborts == [1]
    finally:
        book.stop()


# --- streams: async calls on a side stream, waited for on the waiter's stream ----------

def test_async_runs_on_a_side_stream_after_the_callers_and_wait_orders_the_waiter() -> None:
    clock = Clock()
    book, _ = _book(clock)
    streams = FakeStreams()
    waits = DeviceWaits(book, streams, lambda c, e: e)
    caller = FakeStream("caller")
    work = FakeWork(streams)
    seen: list[Any] = []

    def job() -> None:  # what the engine does on the async worker
        seen.append((streams.current(), current_holder()))
        waits.wait(FakeCall(deadline=clock.now + 5.0), work)

    with streams.use(caller):
        run, holder = waits.adopt_async(job)
    side = streams.side()
    assert side.log == [("follows", caller)], "the side stream must follow the caller's"
    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10.0)
    assert seen == [(side, holder)] and work.waits == [side]
    assert current_holder() is None
    event = holder.event
    assert event is not None and ("record", event) in side.log

    w = Work("all_reduce #1", device=holder)
    w._finish()
    waiter = FakeStream("waiter")
    with streams.use(waiter):
        assert w.wait() is True  # returns: the kernel still runs
    assert waiter.log == [("waits", event)]


def test_is_completed_and_the_future_follow_the_kernels() -> None:
    clock = Clock()
    book, _ = _book(clock)
    streams = FakeStreams()
    holder = DeviceWork(streams)
    work = FakeWork(streams)
    holder.add(book.watch(FakeCall(deadline=clock.now + 5.0), work))
    w = Work("all_reduce #1", result=["out"], device=holder)
    fut = w.get_future()
    w._finish()  # the host part (the enqueue) ended
    assert not w.is_completed() and not fut.done()
    work.completed = True
    assert w.is_completed(), "asked of the kernel directly, not after the ledger's pass"
    assert not fut.done()
    book.tick()
    assert fut.done() and fut.wait() == ["out"]
    assert w.get_future() is fut


def test_a_failed_kernel_fails_the_future_and_wait() -> None:
    clock = Clock()
    book, _ = _book(clock)
    streams = FakeStreams()
    holder = DeviceWork(streams)
    holder.add(book.watch(FakeCall(deadline=clock.now + 1.0), FakeWork(streams)))
    w = Work("all_reduce #1", device=holder)
    w._finish()
    fut = w.get_future()
    clock.now += 2.0
    book.tick()
    assert w.is_completed()
    with pytest.raises(DistTimeout):
        fut.wait()
    with pytest.raises(DistTimeout):
        w.wait()


def test_the_host_stand_in_waits_for_the_verdict() -> None:
    """No streams (CPU tensors): the host waits, bounded, and raises the verdict."""
    clock = Clock()
    book, _ = _book(clock)
    waits = DeviceWaits(book, HostStreams(clock), lambda c, e: e)
    done = FakeWork()
    done.completed = True
    waits.wait(FakeCall(deadline=clock.now + 1.0), done)
    assert done.waits == [None]  # the op's own error, once it is done
    p = book.watch(FakeCall(deadline=clock.now + 1.0), FakeWork())
    book.fail(DistTimeout("the verdict"))
    with pytest.raises(DistTimeout, match="the verdict"):
        HostStreams(clock).order(p)
    stuck = _book(clock)[0].watch(FakeCall(deadline=clock.now - 31.0), FakeWork())
    with pytest.raises(DistTimeout, match="no verdict"):
        HostStreams(clock).order(stuck)


def test_cuda_order_is_a_stream_wait_never_a_timed_one() -> None:
    clock = Clock()
    book, _ = _book(clock)
    work = FakeWork()
    p = book.watch(FakeCall(deadline=clock.now + 1.0), work)
    CudaStreams.order(CudaStreams(torch.device("cpu")), p)
    assert work.waits == [None] and not p.settled.is_set()


class _StreamsLikeCuda(CudaStreams):
    """CUDA streams whose ``order`` is its own method: ``DeviceWaits`` orders through
    ``Streams.order`` whichever it is, so a subclass orders as ``CudaStreams`` does."""

    def order(self, p: Any) -> None:
        CudaStreams.order(self, p)


class _RaisingWork(FakeWork):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.raises = error

    def wait(self, *args: Any) -> bool:
        super().wait(*args)
        raise self.raises


@pytest.mark.parametrize("streams", [CudaStreams, _StreamsLikeCuda])
def test_device_order_on_cuda_streams_waits_each_work_and_explains_its_error(
        streams: type) -> None:
    clock = Clock()
    book, _ = _book(clock)
    waits = DeviceWaits(book, streams(torch.device("cpu")), FakePlane().op_failed)
    assert book.order == waits.order, "Pending.wait orders the same way"
    call = FakeCall(deadline=clock.now + 1.0)
    ok = FakeWork()
    waits.order(call, book.watch(call, ok))
    assert ok.waits == [None], "one stream wait, the host goes on"
    op_error = _RaisingWork(RuntimeError("NCCL error: unhandled cuda error"))
    with pytest.raises(DistTimeout, match="op failed: NCCL error") as raised:
        waits.order(call, book.watch(call, op_error))
    assert raised.value.__suppress_context__, "torch's error is explained, not chained"
    verdict = _RaisingWork(CollectiveMismatch("the book's verdict"))
    with pytest.raises(CollectiveMismatch, match="the book's verdict"):
        waits.order(call, book.watch(call, verdict))
    settled = FakeWork()
    p = book.watch(call, settled)
    p.settle(DistTimeout("aborted past the deadline"))
    with pytest.raises(DistTimeout, match="aborted past the deadline"):
        waits.order(call, p)
    assert settled.waits == [], "a record with an error is not waited for"
    torch_error = FakeWork()
    p = book.watch(call, torch_error)
    p.settle(RuntimeError("NCCL error: remote process exited"))
    with pytest.raises(DistTimeout, match="op failed: NCCL error: remote process exited"):
        waits.order(call, p)  # a torch error it was settled with is explained too
    assert torch_error.waits == []


# --- the device check ---------------------------------------------------------------------

def _call() -> Any:
    group = SimpleNamespace(port=SimpleNamespace(rank=3), name="the default group (WORLD)")
    return SimpleNamespace(group=group, describe=lambda: "all_reduce(float32 x 4, op=SUM)")


def _observed(call: Any, observers: Any) -> Any:
    call.observers = observers
    return call


def test_a_tensor_on_another_device_is_refused_before_any_io() -> None:
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.tensors import DeviceTensors

    tensors = DeviceTensors(torch.device("cpu"))
    tensors.check(_call(), (torch.ones(2), torch.ones(3)))
    other = torch.empty(2, device="meta")  # stands for cuda:1 on a group on cuda:0
    with pytest.raises(InvalidArgument, match=r"rank 3: all_reduce\(float32 x 4, op=SUM\): "
                       r"tensor 1 of the call is on meta, but the default group \(WORLD\)'s "
                       r"NCCL communicator is on cpu"):
        tensors.check(_call(), (torch.ones(2), other))

    engine = TorchEngine.__new__(TorchEngine)  # only what ``_before`` reads
    checked: list[Any] = []
    engine.device = DeviceWaits(_book(Clock())[0], FakeStreams(), lambda c, e: e)
    engine.tensors = tensors
    observed = SimpleNamespace(before=checked.append)  # the call's observers
    with pytest.raises(InvalidArgument, match="is on meta"):
        engine._before(_observed(_call(), observed), other)
    assert checked == [], "the ring check (I/O) ran before the device check"
    engine._before(_observed(_call(), observed), torch.ones(1))
    assert len(checked) == 1


def test_torchs_error_handling_is_off_only_while_rankwise_builds_its_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's default would tear the process down when the works rankwise's book
    aborted report their error; a value the user chose is kept."""
    import os

    from rankwise.engines.torch.nccl import _rankwise_handles_errors

    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    monkeypatch.delenv(name, raising=False)
    with _rankwise_handles_errors():
        assert os.environ[name] == "0"
    assert name not in os.environ
    monkeypatch.setenv(name, "1")
    with _rankwise_handles_errors():
        assert os.environ[name] == "1"
    assert os.environ[name] == "1"


# --- issue 34: one ledger per process; enqueue wakes nobody; async on the caller's thread --

class CountingLedger:
    """A ledger that only counts the wake-ups it is asked for."""

    def __init__(self) -> None:
        self.kicks: list[float] = []
        self.books: list[Any] = []

    def register(self, book: Any) -> None:
        self.books.append(book)

    def unregister(self, book: Any) -> None:
        self.books.remove(book)

    def kick(self, delay: float = 0.0) -> None:
        self.kicks.append(delay)


def test_recording_a_work_wakes_the_ledger_once_not_per_call() -> None:
    clock = Clock()
    on = CountingLedger()
    book = WorkBook(FakePlane(), lambda: None, clock=clock, on=on)  # type: ignore[arg-type]
    book.start()
    for _ in range(100):
        book.watch(FakeCall(deadline=clock.now + 60.0), FakeWork())
        clock.now += 1e-5
    assert on.kicks == [GRACE], "only the first record (nothing due before it) wakes it"
    assert on.books == [book] and book.in_flight() == 100
    clock.now += GRACE
    due = book.pass_due()  # nothing done yet: the next pass is due at the heartbeat
    assert 0 < due <= 0.1 and book.in_flight() == 100
    book.stop()
    assert on.books == []


def test_a_pass_drops_the_finished_records_and_queries_only_then() -> None:
    clock = Clock()
    book, _ = _book(clock)
    works = [FakeWork() for _ in range(5)]
    for w in works:
        book.watch(FakeCall(deadline=clock.now + 60.0), w)
    for w in works[:3]:
        w.completed = True
    book.tick()
    assert book.in_flight() == 2 and len(book.records) == 2, "the done front is dropped"
    for w in works:
        w.completed = True
    assert book.pass_due() == float("inf") and not book.records


def test_one_ledger_thread_serves_every_group_and_a_pushed_failure_wakes_it() -> None:
    from rankwise.core.ledger import ledger

    clock = Clock()
    planes = [FakePlane(), FakePlane()]
    dogs = [WorkBook(p, lambda: None, clock=clock) for p in planes]
    for d in dogs:
        d.start()
    try:
        p = [d.watch(FakeCall(deadline=clock.now + 600.0), FakeWork()) for d in dogs]
        threads = [t for t in threading.enumerate() if t.name == "rankwise-ledger"]
        assert len(threads) == 1 and ledger().books() >= 2
        planes[1].failed = CollectiveMismatch("pushed by the port")
        dogs[1].kick(0.0)  # what the engine's on_failure listener does
        assert p[1].settled.wait(10.0) and p[1].error is planes[1].failed
        assert not p[0].settled.is_set(), "the other group's work runs on"
    finally:
        for d in dogs:
            d.stop()


def test_an_async_call_runs_inline_and_is_ordered_only_when_waited_for() -> None:
    clock = Clock()
    book, _ = _book(clock)
    streams = FakeStreams()
    waits = DeviceWaits(book, streams, lambda c, e: e)
    call = FakeCall(deadline=clock.now + 5.0)
    work, post = FakeWork(streams), FakeWork(streams)
    ran_on: list[int] = []

    def job() -> None:  # what the engine does, on the caller's thread
        ran_on.append(threading.get_ident())
        waits.wait(call, work, then=False)  # a plain all_reduce: nothing reads it next
        waits.wait(call, post, then=True)  # a dtype write-back reads it next

    holder, error = waits.run_inline(call, job)  # type: ignore[arg-type]
    assert error is None and ran_on == [threading.get_ident()] and holder.inline
    assert work.waits == [] and post.waits == [streams.default]
    assert streams.events == 0 and streams.side().log == [], "no event, no side stream"
    assert current_holder() is None
    w = Work.ended("all_reduce #1", None, holder, None)
    assert not w.is_completed()
    w.wait()
    assert work.waits == [streams.default], "wait() orders the waiter's stream"
    work.completed = post.completed = True
    assert w.is_completed()

    def failing() -> None:
        raise CollectiveMismatch("found before the op")

    _, error = waits.run_inline(call, failing)  # type: ignore[arg-type]
    assert isinstance(error, CollectiveMismatch)
    with pytest.raises(CollectiveMismatch):
        Work.ended("all_reduce #2", None, None, error).wait()


def test_the_ring_checks_batch_is_sent_once_whoever_flushes_it() -> None:
    """The caller appends entries while the ledger's thread flushes, with no lock
    between them: every entry goes out exactly once."""
    from rankwise.core.ring_check import RingCheck

    sent: list[bytes] = []
    check = RingCheck.__new__(RingCheck)
    check._entries = __import__("collections").deque()
    check._last = SimpleNamespace(seq=1, site=SimpleNamespace(id=0))  # type: ignore[assignment]
    check.group = SimpleNamespace(id=3, timeout=5.0)  # type: ignore[assignment]
    check.next = 1
    check.comm = SimpleNamespace(  # type: ignore[assignment]
        send_frame=lambda dst, header, payload, deadline, site: sent.append(bytes(payload)))
    entries = [i.to_bytes(8, "little") for i in range(20000)]
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            check.flush()

    t = threading.Thread(target=flusher)
    t.start()
    for e in entries:
        check._entries.append(e)
    stop.set()
    t.join(10.0)
    check.flush()
    got = b"".join(sent)
    assert sorted(got[i:i + 8] for i in range(0, len(got), 8)) == sorted(entries)
    assert check.deferred is None


class CountedWork(FakeWork):
    """A ``FakeWork`` that counts the event queries made of it."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def is_completed(self) -> bool:
        self.queries += 1
        return super().is_completed()


def test_a_pass_asks_a_few_of_one_streams_works_and_each_unordered_one() -> None:
    clock = Clock()
    book, _ = _book(clock)
    works = [CountedWork() for _ in range(16)]
    p2p = CountedWork()
    for i, w in enumerate(works):
        book.watch(FakeCall(deadline=clock.now + 60.0), w, ordered=True)
        if i == 3:
            book.watch(FakeCall(deadline=clock.now + 60.0), p2p)  # another stream: asked
    for w in works[:11]:
        w.completed = True
    p2p.completed = True
    book.tick()
    assert book.in_flight() == 5 and len(book.records) == 5, "the done front is dropped"
    assert sum(w.queries for w in works) <= 6 and p2p.queries == 1, "a binary search"
    for w in works:
        w.completed = True
        w.queries = 0
    assert book.pass_due() == float("inf") and not book.records
    assert sum(w.queries for w in works) == 1, "the newest done vouches for the rest"


def test_an_ordered_works_error_still_fails_the_group() -> None:
    clock = Clock()
    book, aborts = _book(clock)
    works = [FakeWork() for _ in range(4)]
    for w in works:
        book.watch(FakeCall(deadline=clock.now + 60.0), w, ordered=True)
    works[0].completed = True
    works[3].error = RuntimeError("NCCL error: unhandled system error")
    book.tick()
    assert aborts == [1] and book.failed is not None and "unhandled system" in str(book.failed)
