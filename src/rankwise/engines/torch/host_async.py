"""An ``async_op`` call on torch's gloo, run on the caller's thread and completed by gloo's.

Why: gloo runs every op on threads of its own, so an async call needs no thread of
rankwise's. DDP's bucket all_reduce used to hop to rankwise's async worker, which then
waited for gloo: one more thread to wake and one more handover of the GIL per bucket, on
every rank (about 0.5 ms of CPU a step on the DDP tutorial). Here (``HostAsync``) the
call's checks run on the caller's thread, as a blocking call's do; its op is enqueued on
gloo and handed to the group's book (``work_book``: grace, slow-call, deadlock-probe and
deadline hooks, the same bound a device call has); gloo's future, when the op ends, runs
the call's write-back (``post``), settles the record and with it the ``Work``'s future
(DDP's bucket callbacks then run on gloo's thread, as they do under gloo itself).
``Work.wait()`` waits as a blocking call does (``host_wait.WorkWaiter``).

Only calls whose body ends with the engine's op take this way (``api.path``: ``split``):
a body that reads the result after the op returns needs the op done by then.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..base import EngineFact
from .device_waits import InlineWork
from .failures import TORCH_ERRORS
from .streams import Streams
from .work_book import Pending, WorkBook

if TYPE_CHECKING:
    from ..base import Call
    from .device_waits import CommPlane
    from .host_wait import WorkWaiter

__all__ = ["SETTLE_MIN", "HostAsync"]

Post = Callable[[], object]
#: the least a waiter gives gloo's callback to finish a record it claimed (its write-back),
#: in seconds; otherwise it gives it until the call's deadline
SETTLE_MIN = 1.0


class HostAsync:
    """The split async calls of one gloo-backed group: ``run_inline`` (``Caps.run_split``)
    runs a call here, ``watch`` hands its op to the book and to gloo's future, and
    ``order`` (``Work.wait()``) waits for it on the host."""

    #: no streams on the host: ``InlineWork`` asks these, and they have nothing to do
    streams = Streams()

    def __init__(self, book: WorkBook, waiter: WorkWaiter, plane: CommPlane) -> None:
        self.book = book
        self.waiter = waiter
        self.plane = plane
        #: who finishes a record, gloo's callback or a waiter: the first to claim it
        self._claim = threading.Lock()
        book.order = self.order  # ``Pending.wait``

    def run_inline(self, call: Call, job: Callable[..., None], *args: Any
                   ) -> tuple[InlineWork, BaseException | None]:
        """Run ``job(*args)`` (an ``async_op`` call) here; its engine side (the records
        ``watch`` appends) and the error it raised, for ``Work.wait()``."""
        self.book.start()  # the ledger's pass: made on a group's first async call
        holder = InlineWork(self, call)
        call.inline = holder.pendings
        try:
            job(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to Work.wait()
            return holder, exc
        finally:
            call.inline = None
        return holder, None

    def watch(self, call: Call, work: Any, post: Post | None = None) -> None:
        """``work`` (just enqueued on gloo for ``call``, run split) to the book; gloo's
        future finishes it (``post``, then settled) when the op ends."""
        p = self.book.watch(call, work)
        p.post = post
        assert call.inline is not None
        call.inline.append(p)
        work.get_future().add_done_callback(functools.partial(self._ended, p))

    def _ended(self, p: Pending, future: Any) -> None:
        """gloo's thread: the op ended (or failed, or was aborted)."""
        if not p.is_settled:
            self._finish(p, future)

    def _finish(self, p: Pending, future: Any) -> None:
        """Settle ``p``: the job's failure, the op's own error, or done (its ``post``
        run first); once, by whoever claims it first (gloo's callback or a waiter).
        The op's outcome is read from its ended ``future``: gloo completes it before the
        work, so inside its callback ``work.wait()`` would wait for itself."""
        with self._claim:
            if p.claimed or p.is_settled:
                return
            p.claimed = True
        try:
            book, plane = self.book, self.plane
            failure = plane.failure()  # a mismatch or a lost peer: never good data
            if failure is None:
                try:
                    future.value()  # ended: raises the op's own error, if any
                except TORCH_ERRORS as err:
                    failure = plane.op_failed(p.call, err)
            if failure is not None:
                book.fail(failure)
                return
            if p.post is not None:
                p.post()
            book.settle((p,), None)
        except BaseException as exc:  # noqa: BLE001 - a bad post-step fails the call
            self.book.settle((p,), exc)

    def order(self, call: Call, p: Pending) -> None:
        """``Work.wait()``: the host waits for ``p`` as a blocking call waits (bounded,
        the control plane's failures raised at once), then for its write-back."""
        if not p.is_settled:
            try:
                self.waiter.wait(call, p.work)
            except EngineFact as fact:  # past the deadline, or the op failed
                error = self.plane.port.explain(call, fact)
                self.book.fail(error)
                raise error from None
            self._finish(p, p.work.get_future())  # the work is done: so is its future
            # gloo's callback claimed it: its write-back is brief, and still bounded
            if not p.is_settled and \
                    not p.settled.wait(max(SETTLE_MIN, call.deadline - time.monotonic())):
                error = self.plane.timed_out(call)
                self.book.fail(error)
                raise error
        if p.error is not None:
            raise p.error
