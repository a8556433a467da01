"""How a device call waits: each torch work goes to the group's book (``work_book``, which
the ledger's thread passes over: the bound), the stream that runs next is ordered after
it (``streams``: no host block on CUDA), and an async call's device part keeps its works
for ``Work.wait()``. ``CommPlane`` is what the book asks the control plane.

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

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...by_thread import ByThread
from ..base import DeadlinePassed
from .failures import from_torch, op_failed
from .work_book import Pending, WorkBook

if TYPE_CHECKING:
    from ..base import Call
    from .host_wait import WorkWaiter
    from .streams import Streams

__all__ = ["CommPlane", "DeviceWaits", "DeviceWork", "InlineWork", "OrderedWork",
           "current_holder"]


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
        book known by now is raised."""
        error = self.error()
        if error is not None:
            raise error
        self.streams.wait_event(self.event)

    def when_done(self, fn: Callable[[BaseException | None], None]) -> None:
        """``fn(error)`` once every torch work of the call is settled (on the ledger's
        thread, or here if they are): futures complete when the kernels have."""
        pendings = list(self.pendings)
        if len(pendings) == 1:  # most calls: one work, no count to keep
            pendings[0].on_settled(lambda _: self._settled(fn))
            return
        left = [len(pendings)]
        lock = threading.Lock()

        def one(_: Pending) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._settled(fn)

        if not pendings:
            fn(None)
            return
        for p in pendings:
            p.on_settled(one)

    def _settled(self, fn: Callable[[BaseException | None], None]) -> None:
        """``when_done``'s end: every work settled, ``fn`` told how the call ended."""
        error = self.error()
        if error is None:
            self.streams.synchronize(self.event)  # the kernels are done: brief
        fn(error)


class Orders(Protocol):
    """What an ``OrderedWork`` asks of whoever made it: the streams, and ``order(call,
    p)``, which makes what runs next see ``p``'s result (``DeviceWaits``; on gloo,
    ``host_async.HostAsync``, which waits on the host)."""

    streams: Streams

    def order(self, call: Call, p: Pending) -> None: ...


class OrderedWork(DeviceWork):
    """The device side of a ``Work`` whose torch works were enqueued on the caller's
    thread (an NCCL ``isend``): ``wait`` orders the waiter's stream after each of them
    (torch's ``WorkNCCL.wait()``; the host waits only on the CPU stand-in)."""

    __slots__ = ("_call", "_waits")

    def __init__(self, waits: Orders, call: Call, pendings: list[Pending]) -> None:
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

    def __init__(self, waits: Orders, call: Call) -> None:  # once per call: flat
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
    """How the device engine waits for a torch work: the group's book watches it, the
    current stream is ordered after it (``Streams.order``), and an async call's
    ``DeviceWork`` remembers it. ``op_failed`` explains a torch op's own error."""

    def __init__(self, book: WorkBook, streams: Streams,
                 op_failed: Callable[[Call, BaseException], BaseException]) -> None:
        self.book = book
        self.streams = streams
        self._op_failed = op_failed
        self.in_order = streams.in_order
        #: ``order(call, p)``: what runs next on this thread sees ``p``'s result
        #: (``Streams.order``; a torch error of the op itself explained by ``op_failed``)
        self.order: Callable[[Call, Pending], None] = self._order_on_streams
        book.order = self.order  # ``Pending.wait``: an async call's one work

    def wait(self, call: Call, work: Any, then: bool = True) -> None:
        """Hand ``work`` to the book and order what runs next after it; an inline
        async call (``run_inline``) orders it only when waited for, unless ``then``
        says the caller's stream reads the result next (a post-step). Only the group's
        own collectives come here (p2p works use ``watch``): they share one stream."""
        p = self.book.watch(call, work, self.in_order)
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
        """Hand ``work`` to the book (and to the async call running here, if any)."""
        p = self.book.watch(call, work)
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
        book's verdict (a ``DistError``) and anything but a torch ``RuntimeError`` as
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
        """The book aborted the group: every later call raises why."""
        failed = self.book.failed
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


class CommPlane:
    """The control plane as the group's book sees it (``work_book.Plane``): the port's
    failure state, slow and deadlock hooks, and its wording of a call's failure (the
    book reports a call's failure after the call returned, outside the API's guard).
    ``flush`` sends the ring check's batch; it returns False when the check is busy on
    the calling thread (asked again on the next pass)."""

    def __init__(self, waiter: WorkWaiter, flush: Callable[[], bool]) -> None:
        self.waiter = waiter
        self.port = waiter.port
        self._flush = flush

    def failure(self) -> BaseException | None:
        if self.port.failure is None:
            return None
        try:
            self.port.raise_failure()
        except BaseException as exc:  # noqa: BLE001 - handed to the book
            return exc
        return None

    def slow(self, call: Call) -> bool:
        return self._flush()

    def warn_at(self, call: Call, start: float) -> float:
        return float("inf") if call.patient or call.quiet else start + self.port.warn_after

    def warn(self, call: Call) -> None:
        self.port.slow(call, self.waiter._where)

    def probe_at(self, start: float) -> float:
        return start + self.port.stuck_after

    def probe(self, blocked_for: float) -> float:
        return self.port.probe(blocked_for)

    def timed_out(self, call: Call) -> BaseException:
        self.waiter.stuck = True
        return self.port.explain(call, DeadlinePassed(self.waiter._where))

    def op_failed(self, call: Call, err: BaseException) -> BaseException:
        if from_torch(err):
            return self.port.explain(call, op_failed(self.port.rank, self.waiter.engine_name,
                                                     call, err))
        return err
