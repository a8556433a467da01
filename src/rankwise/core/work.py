"""``Work``: the handle an ``async_op=True`` call returns, as in torch.distributed.

Async collectives run, in call order, on one worker thread per communicator (so one per
process; one per rank when ranks are threads); their sequence numbers are taken when the
user calls, so concurrent operations never mix their frames.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import DistTimeout
from ..slots import slot_maker
from .future import Future

__all__ = ["Work", "completed_work", "in_flight", "new_ended", "run_async"]


class Work:
    """Completion handle of one communication call.

    ``device``: the call's part on a device (NCCL: ``engines.torch.device_waits.DeviceWork``)
    that goes on after the host part ended, as torch's: ``wait`` orders the current
    stream after it, ``is_completed`` asks its kernels, the future completes with them.
    Slots: an async device call makes one per call (``ended``); subclasses may add a
    ``__dict__`` of their own."""

    __slots__ = ("__weakref__", "_description", "_done", "_error", "_future", "_future_lock",
                 "_result", "device")

    def __init__(self, description: str, result: Any = None, device: Any = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result = result
        self._description: str | Callable[[], str] = description
        self._future: Future | None = None
        self._future_lock = threading.Lock()
        self.device = device

    @classmethod
    def ended(cls, description: Callable[[], str], result: Any, device: Any,
              error: BaseException | None) -> Work:
        """A ``Work`` whose host part has already ended (a device call run on the
        caller's thread): no event of its own to make, one shared set one instead.
        ``description`` is made only when asked for (errors, ``repr``): formatting it on
        every call cost ~0.5 us."""
        return _new_ended(error, result, description, device)

    @property
    def description(self) -> str:
        """``all_reduce #5 on default_pg``: what the call was, for messages."""
        d = self._description
        if not isinstance(d, str):
            d = self._description = d()
        return d

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        with self._future_lock:
            self._done.set()
            future = self._future
        if future is not None:
            self._settle(future)

    def _settle(self, future: Future) -> None:
        if self._error is None and self.device is not None:
            self.device.when_done(lambda error: self._complete(future, error))
            return
        self._complete(future, self._error)

    def _complete(self, future: Future, error: BaseException | None) -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(self._result)

    def when_done(self, fn: Callable[[BaseException | None], None]) -> None:
        """``fn(error)`` once the call has completed, host and device part (at once if it
        has): what a caller that keeps its own future needs, without this work's
        (``torch._work.AsyncWork``: one future and one lock less per DDP bucket)."""
        if not self._done.is_set():
            self.get_future().add_done_callback(lambda _: fn(self._error))
        elif self._error is None and self.device is not None:
            self.device.when_done(fn)
        else:
            fn(self._error)

    def get_future(self) -> Future:
        """A ``Future`` completed with this call's output tensors (a list, as torch's) when
        the call completes, or with its error; ``then`` chains work after it (DDP
        communication hooks)."""
        with self._future_lock:
            if self._future is not None:
                return self._future
            self._future = future = Future()
            done = self._done.is_set()
        if done:
            self._settle(future)
        return future

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; re-raise its error in this thread."""
        done = self._done
        if done is not _ENDED and not done.is_set():  # an inline call's has ended: no ask
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if not done.wait(seconds):
                raise DistTimeout(f"{self.description} did not complete within {seconds}s")
        if self._error is not None:
            raise self._error
        if self.device is not None:
            self.device.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() and (self.device is None or self.device.done())

    def done_within(self, timeout: float) -> bool:
        """Wait (bounded) for completion without raising the operation's error."""
        return self._done.wait(timeout)

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<rankwise.Work {self.description} {state}>"


#: the ``_done`` of every ``Work.ended``: set once, never cleared; and the lock their
#: futures are made under (only ``get_future`` takes it: rare, and brief)
_ENDED = threading.Event()
_ENDED.set()
_ENDED_LOCK = threading.Lock()


class _Ended(Work):
    """A ``Work.ended``: what every one shares lives on the class (``_done`` and
    ``_future_lock``, never set on one), the rest in its slots, stored by the C maker
    where it was built (``rankwise.slots``): ~0.2 us less per async device call."""

    __slots__ = ()
    _done = _ENDED
    _future_lock = _ENDED_LOCK


_new_ended = slot_maker(_Ended, ("_error", "_result", "_description", "device", "_future"),
                        (None,))
#: ``Work.ended(description, result, device, error)`` as ``new_ended(error, result,
#: description, device)``: the maker itself, for the device hot path's C steps
new_ended = _new_ended


def completed_work(description: str, result: Any = None) -> Work:
    w = Work(description, result)
    w._finish()
    return w


class _Worker:
    """One daemon thread running queued operations in order.

    Each job's closure (and its ``Work``) is dropped as soon as the job ends, and
    ``stop`` joins the thread (bounded): a daemon thread still releasing the last job's
    arrays (numpy views of torch tensors) while the interpreter shuts down can abort
    the process ("terminate called without an active exception").
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Work, Callable[[], None]] | None] = \
            queue.SimpleQueue()
        #: jobs handed in and jobs ended: their difference is the async work in flight,
        #: which the deadlock detector must see (it may still satisfy someone's wait).
        #: ``submitted`` changes under ``_worker_lock``, ``ended`` on the worker only.
        self.submitted = 0
        self.ended = 0
        self._thread = threading.Thread(target=self._run, name="rankwise-async", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn = item
            del item
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to Work.wait()
                work._finish(exc)
                del exc
            else:
                work._finish()
            self.ended += 1
            # drop the finished job now, not when the next one arrives (see the class doc)
            del work, fn

    def submit(self, work: Work, fn: Callable[[], None]) -> None:
        self._queue.put((work, fn))

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the queued jobs; wait up to ``timeout`` s. True if the thread ended."""
        self._queue.put(None)
        if self._thread is threading.current_thread():
            return False  # stopping from a job of our own: it ends after this job
        self._thread.join(timeout)
        return not self._thread.is_alive()


#: one worker per owner (the communicator): a process has one, and each thread-rank of an
#: in-process job its own, so one rank's blocked call never queues another rank's behind it
_workers: dict[object, _Worker] = {}
_worker_lock = threading.Lock()


def run_async(description: str, fn: Callable[[], None], result: Any = None,
              device: Any = None, owner: object = None) -> Work:
    """Queue ``fn`` on ``owner``'s worker (made on first use; the API's owner is the
    communicator, ``None`` an anonymous one) and return its ``Work``."""
    with _worker_lock:
        worker = _workers.get(owner)
        if worker is None:
            worker = _workers[owner] = _Worker()
        work = Work(description, result, device)
        worker.submitted += 1
        worker.submit(work, fn)
    return work


def in_flight(owner: object = None) -> int:
    """Async operations handed in and not yet ended (slow path only): ``owner``'s, or
    (``None``) every worker's of this process."""
    with _worker_lock:
        workers = list(_workers.values()) if owner is None else \
            [w for w in (_workers.get(owner),) if w is not None]
    return sum(max(0, w.submitted - w.ended) for w in workers)


def stop_worker(timeout: float = 5.0, *, owner: object = None) -> None:
    """Stop ``owner``'s async worker, or (``None``) every one, and join each (bounded by
    ``timeout`` seconds)."""
    with _worker_lock:
        keys = list(_workers) if owner is None else [owner]
        stopped = [w for w in (_workers.pop(k, None) for k in keys) if w is not None]
    for worker in stopped:
        worker.stop(timeout)
