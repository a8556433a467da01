"""Ordering work after a device collective without blocking the host.

Why a seam: on CUDA, "wait for the collective" means "the current stream waits for the
collective's kernel" (torch's ``WorkNCCL.wait()``, an event wait on the stream), which
the host never blocks on; on the test stand-in (torch's gloo over CPU tensors) there is
no stream, so waiting means the host waits until the watchdog settles the work. The
engine uses one interface (``Streams``) for both, and tests pass a fake one.

``async_op`` (``run_inline``): the call runs on the caller's thread, as torch's does: its
works are enqueued after what the caller's current stream holds (NCCL orders its stream
after the current one), no hop to a worker thread, no side stream and no event of
rankwise's own; ``Work.wait()`` makes the waiting thread's current stream wait for each
work (``OrderedWork``: torch's ``WorkNCCL.wait()``). A call whose post-step reads the
result on the caller's stream (a dtype write-back) orders that stream first.
(``adopt_async``, the side-stream path for a call run on the async worker, stays for
callers that queue device calls there.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ...by_thread import ByThread
from ...errors import DistTimeout
from .failures import from_torch
from .work_book import Pending, WorkBook

if TYPE_CHECKING:
    from ..base import Call

__all__ = ["CudaStreams", "DeviceWaits", "DeviceWork", "HostStreams", "OrderedWork",
           "Streams", "current_holder"]

#: seconds the host stand-in waits past a call's deadline for the watchdog's verdict
_MARGIN = 30.0


class Streams:
    """The stream operations the device engine needs (CUDA: ``CudaStreams``)."""

    #: a group's collectives finish in the order they were enqueued (NCCL: one stream
    #: per communicator), so the watchdog need not ask each one (``WorkBook.watch``)
    in_order = False

    def current(self) -> Any:
        """The calling thread's current stream (None: no streams here)."""
        return None

    def side(self) -> Any:
        """The engine's side stream for async calls (one: the async worker is serial)."""
        return None

    def follow(self, stream: Any, other: Any) -> None:
        """``stream`` waits for what is queued on ``other`` now (no host block)."""

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` this thread's current stream inside the block."""
        yield

    def record(self, stream: Any) -> Any:
        """An event marking what is queued on ``stream`` now."""
        return None

    def wait_event(self, event: Any) -> None:
        """The current stream waits for ``event`` (no host block)."""

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        """The host waits for ``event`` (only where the work is known to be done)."""

    def order(self, p: Pending) -> None:
        """Whatever runs next on this thread sees the collective's result."""
        raise NotImplementedError


class CudaStreams(Streams):
    """Real CUDA streams of ``device``; ``order`` is torch's ``WorkNCCL.wait()``: the
    current stream waits for the collective's end event, the host goes on."""

    in_order = True

    def __init__(self, device: Any) -> None:
        import torch

        self.torch: Any = torch
        self.device = device
        self._side: Any = None

    def current(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def side(self) -> Any:
        if self._side is None:
            self._side = self.torch.cuda.Stream(device=self.device)
        return self._side

    def follow(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with self.torch.cuda.stream(stream):
            yield

    def record(self, stream: Any) -> Any:
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, event: Any) -> None:
        if event is not None:
            self.current().wait_event(event)

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def order(self, p: Pending) -> None:
        if p.error is not None:
            raise p.error
        p.work.wait()  # a stream wait: the host does not block (no TORCH_NCCL_BLOCKING_WAIT)


class HostStreams(Streams):
    """No streams (the stand-in's CPU tensors): ``order`` blocks the host until the
    watchdog settles the work, bounded, then raises its error or the op's own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

    def order(self, p: Pending) -> None:
        end = p.call.deadline + _MARGIN
        delay = 20e-6
        while not p.done():  # polled here: the ledger's pass may be much later
            left = end - self.clock()
            if left <= 0:
                raise DistTimeout(f"{p.call.describe()}: no verdict from the watchdog "
                                  f"{_MARGIN:.0f}s past the deadline")
            if self.clock() >= p.call.deadline:
                p.book.kick(0.0)  # past the deadline: the verdict is due now
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.005)
        if p.error is not None:
            raise p.error
        p.work.wait()  # done: raises the op's own error, if any
        p.settle(None)  # seen done here: its future need not wait for the watchdog


#: the ``DeviceWork`` of the async call running on each thread that runs one
#: (``DeviceWork.run_on``). A ``ByThread``, not a ``threading.local``: a device call asks
#: on every call, and while no async job runs anywhere that is one truth test
holders: ByThread[DeviceWork] = ByThread()


def current_holder() -> DeviceWork | None:
    """The ``DeviceWork`` of the async call running on this thread, if any."""
    return holders.mine()


class DeviceWork:
    """The device side of one async ``Work``: its torch works in flight and the event
    that ends its side stream's part (see the module's doc)."""

    #: the call runs on the caller's thread (``DeviceWaits.run_inline``): its works are
    #: ordered when waited for, not at the call
    inline = False
    #: one is made per async device call: slots make it ~0.15 us cheaper than a dict
    __slots__ = ("event", "pendings", "streams")

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.pendings: list[Pending] = []
        self.event: Any = None

    def run_on(self, side: Any, job: Callable[[], None]) -> None:
        """Run ``job`` (the call, on the async worker) with this holder current and
        ``side`` as the current stream; mark the side stream's end."""
        holders.set_mine(self)
        try:
            with self.streams.use(side):
                job()
                self.event = self.streams.record(side)
        finally:
            holders.set_mine(None)

    def add(self, p: Pending) -> None:
        self.pendings.append(p)

    def error(self) -> BaseException | None:
        for p in self.pendings:
            if p.error is not None:
                return p.error
        return None

    def done(self) -> bool:
        """As torch's ``is_completed``: every kernel of the call has finished."""
        return all(p.done() for p in self.pendings) and self.streams.query(self.event)

    def wait(self) -> None:
        """The current stream waits for the call (no host block); a verdict of the
        watchdog known by now is raised."""
        error = self.error()
        if error is not None:
            raise error
        self.streams.wait_event(self.event)

    def when_done(self, fn: Callable[[BaseException | None], None]) -> None:
        """``fn(error)`` once every torch work of the call is settled (on the watchdog's
        thread, or here if they are): futures complete when the kernels have."""
        pendings = list(self.pendings)
        left = [len(pendings)]
        lock = threading.Lock()

        def one(_: Pending) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                error = self.error()
                if error is None:
                    self.streams.synchronize(self.event)  # the kernels are done: brief
                fn(error)

        if not pendings:
            fn(None)
            return
        for p in pendings:
            p.on_settled(one)


class OrderedWork(DeviceWork):
    """The device side of a ``Work`` whose torch works were enqueued on the caller's
    thread (an NCCL ``isend``): ``wait`` orders the waiter's stream after each of them
    (torch's ``WorkNCCL.wait()``; the host waits only on the CPU stand-in)."""

    __slots__ = ("_call", "_waits")

    def __init__(self, waits: DeviceWaits, call: Call, pendings: list[Pending]) -> None:
        super().__init__(waits.streams)
        self.pendings = pendings
        self._waits = waits
        self._call = call

    def wait(self) -> None:
        for p in self.pendings:
            self._waits.order(self._call, p)


class InlineWork(OrderedWork):
    """The device side of an ``async_op`` call run on the caller's thread."""

    inline = True
    __slots__ = ()

    def __init__(self, waits: DeviceWaits, call: Call) -> None:  # once per call: flat
        self.streams = waits.streams
        self.pendings = []
        self.event = None
        self._waits = waits
        self._call = call

    def wait(self) -> None:  # ``OrderedWork.wait`` with its lookups out of the loop
        order, call = self._waits.order, self._call
        for p in self.pendings:
            order(call, p)


class DeviceWaits:
    """How the device engine waits for a torch work: the watchdog watches it, the
    current stream is ordered after it (``Streams.order``), and an async call's
    ``DeviceWork`` remembers it. ``op_failed`` explains a torch op's own error."""

    def __init__(self, watchdog: WorkBook, streams: Streams,
                 op_failed: Callable[[Call, BaseException], BaseException]) -> None:
        self.watchdog = watchdog
        self.streams = streams
        self._op_failed = op_failed
        self.in_order = streams.in_order
        #: ``order(call, p)``: what runs next on this thread sees ``p``'s result
        #: (``Streams.order``; a torch error of the op itself explained by ``op_failed``)
        self.order: Callable[[Call, Pending], None] = self._order_on_streams
        watchdog.order = self.order  # ``Pending.wait``: an async call's one work

    def wait(self, call: Call, work: Any, then: bool = True) -> None:
        """Hand ``work`` to the watchdog and order what runs next after it; an inline
        async call (``run_inline``) orders it only when waited for, unless ``then``
        says the caller's stream reads the result next (a post-step). Only the group's
        own collectives come here (p2p works use ``watch``): they share one stream."""
        p = self.watchdog.watch(call, work, self.in_order)
        inline = call.inline
        if inline is not None:  # ``run_inline``'s call: ordered by ``Work.wait()``
            inline.append(p)
            if not then:
                return
        elif holders:  # an async call runs on some thread: on this one?
            holder = holders.mine()
            if holder is not None:
                holder.pendings.append(p)
        self.order(call, p)

    def run_inline(self, call: Call, job: Callable[..., None], *args: Any
                   ) -> tuple[InlineWork, BaseException | None]:
        """Run ``job(*args)`` (an ``async_op`` call) here, on the caller's thread and
        stream; its device side, and the error it raised (for ``Work.wait``). ``args``
        rather than a closure: one function call less per async call."""
        holder = InlineWork(self, call)
        call.inline = holder.pendings  # the call carries it: no thread-local per call
        try:
            job(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to Work.wait()
            return holder, exc
        finally:
            call.inline = None  # the call stays in the group's history: not its works
        return holder, None

    def watch(self, call: Call, work: Any) -> Pending:
        """Hand ``work`` to the watchdog (and to the async call running here, if any)."""
        p = self.watchdog.watch(call, work)
        inline = call.inline
        if inline is not None:
            inline.append(p)
        else:
            holder = current_holder()
            if holder is not None:
                holder.add(p)
        return p

    def order_failed(self, call: Call, err: BaseException) -> BaseException:
        """What ``order`` raises for ``err``, raised while it ordered the stream: the
        watchdog's verdict (a ``DistError``) and anything but a torch ``RuntimeError`` as
        they are; the op's own failure (torch raised it) explained by ``op_failed``."""
        if from_torch(err):
            return self._op_failed(call, err)
        return err

    def _order_on_streams(self, call: Call, p: Pending) -> None:
        """``order`` on any ``Streams``."""
        try:
            self.streams.order(p)
        except BaseException as err:
            failure = self.order_failed(call, err)
            if failure is err:
                raise
            raise failure from None

    def raise_failed(self) -> None:
        """The watchdog aborted the group: every later call raises why."""
        failed = self.watchdog.failed
        if failed is not None:
            raise failed

    def adopt_async(self, job: Callable[[], None]) -> tuple[Callable[[], None], DeviceWork]:
        """``job`` (an async call, about to be queued) made to run on the side stream,
        after what the caller's stream holds now; its ``DeviceWork`` for the ``Work``."""
        streams = self.streams
        side = streams.side()
        streams.follow(side, streams.current())
        holder = DeviceWork(streams)
        return lambda: holder.run_on(side, job), holder
