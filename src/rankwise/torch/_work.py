"""The ``torch.distributed.Work`` handles the backend returns.

Why not ``_create_work_from_future`` for a call that already ran: it needs a torch
``Future`` set with the result first, and the two cost ~3 us per call, about as much as
the whole of torch's Python wrapper. :class:`DoneWork` is one small Python object whose
future is made only when asked for (DDP's reducer asks, ``work.wait()`` does not).

torch's C++ side reaches a Python ``Work`` through two methods only, ``wait`` and
``get_future`` (``PyProcessGroup::PyWork``); everything else (``is_completed``,
``exception``, ``result``, ``source_rank``) is answered here for Python callers.
"""

from __future__ import annotations

import _thread
import functools
import operator
import threading
from collections.abc import Generator
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as tdist
from torch.futures import Future

from ..core.work import Work as RankwiseWork
from ..errors import DistError
from ..rewrap import bare, dropped, frameless, note

__all__ = ["AsyncWork", "ChainedAsyncWork", "DoneWork", "RecvWork"]


def _future_of(result: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(result)
    return fut


def _spent() -> Generator[None, None, None]:
    yield  # never reached: the generator is closed before its first step


class _Failed:
    """The value of a torch future whose rankwise call failed (``fail_future``).

    C++ reads tensors out of a value by pickling it, and pickling calls ``__reduce__``
    (object's ``__reduce_ex__`` does, with no argument): here the ``throw`` of a spent
    generator, which raises its argument from C without entering a frame, so what torch
    formats of it lists none of rankwise's (``rewrap``). Python reads it through the
    future's unwrap function (:meth:`throw`), except where the future crossed torch's C++,
    which keeps no unwrap function (under torch's own ``ProcessGroup``, 2.14+: a comm
    hook's ``fut.value()[0]``): indexing or iterating it raises the error too."""

    __slots__ = ("__reduce__", "error")

    def __init__(self, error: BaseException) -> None:
        self.error = error
        spent = _spent()
        spent.close()
        # a slot, set per object (mypy sees object's method)
        self.__reduce__ = functools.partial(spent.throw, bare(error))  # type: ignore[method-assign,assignment]

    def throw(self, *_: Any) -> NoReturn:
        """Raise the error, leaving with no frame of rankwise's on it."""
        try:
            raise self.error
        except DistError as error:
            if dropped(error):
                raise
            raise error  # noqa: TRY201 - Python 3.10: with this frame only

    __getitem__ = __iter__ = throw


def fail_future(future: Future[Any], error: BaseException) -> None:
    """Complete ``future`` with ``error``. In Python its ``wait()`` and ``value()`` raise
    it, as after ``Future.set_exception``; in C++, where DDP's reducer takes a bucket's
    tensors out of the value by pickling it (``parseCppCommHookResult``), the pickling
    raises it too, and backward raises it. Why not ``set_exception``: it stores the error
    as a plain value, in which C++ finds no tensor, and the reducer then indexes an empty
    list: rank 0 of a DDP job whose bucket all_reduce failed died of SIGSEGV instead of
    raising (seen under load, when the error came before backward's end).

    Completed from a thread of its own that runs no Python frame (``set_result`` called
    from C): torch runs the future's callbacks there, and where one raises it (a DDP comm
    hook's ``then``) torch's message lists the frames above the callback, which would be
    the completing thread's, rankwise's (``rewrap``). Returns once the future is done."""
    note(error)  # rankwise.unwrap finds it in what torch makes of it
    future._set_unwrap_func(_Failed.throw)
    _thread.start_new_thread(future.set_result, (_Failed(error),))
    try:
        future.wait()  # done when set: torch wakes waiters before it runs the callbacks
    except BaseException:  # noqa: BLE001, S110 - the error it now holds
        pass


class DoneWork(tdist.Work):
    """A call that completed inline; its future holds ``result`` (torch's convention:
    the output tensors)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result
        self._future: Future[Any] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        return None

    def get_future(self) -> Future[Any]:
        if self._future is None:
            self._future = _future_of(self._result)
        return self._future


class _RankwiseBacked(tdist.Work):
    """A torch ``Work`` answered by a rankwise ``Work`` (``_inner``) over ``_tensors``."""

    def __init__(self, inner: RankwiseWork, tensors: list[Any]) -> None:
        super().__init__()
        self._inner, self._tensors = inner, tensors

    @frameless
    def wait(self, timeout: timedelta | None = None) -> bool:
        return bool(self._inner.wait(timeout if timeout else None))

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def result(self) -> Any:
        self.wait()
        return self._tensors


class AsyncWork(_RankwiseBacked):
    """A call running on rankwise's async worker (``launch(..., async_op=True)``): its
    torch future completes on that worker when the call has run, so what torch chains
    on it (DDP's bucket callbacks, a comm hook's ``then``) runs there, beside backward,
    as on gloo's worker thread."""

    def __init__(self, inner: RankwiseWork, tensors: list[Any]) -> None:
        super().__init__(inner, tensors)
        self._future: Future[Any] = Future()
        self._settling = threading.RLock()  # a callback may wait() on it
        self._settled = False
        inner.when_done(self._settle)

    def _settle(self, error: BaseException | None = None) -> None:
        with self._settling:  # the worker's callback and wait() may both get here: the
            if self._settled:  # second returns once the future is complete
                return
            self._settled = True
            self._complete(error)

    def _complete(self, error: BaseException | None) -> None:
        if error is None:  # from ``wait``: the host part's error, or the device part's
            device = self._inner.device
            error = self._inner.exception() or (device.error() if device is not None else None)
        if error is not None:
            fail_future(self._future, error)
        else:
            self._future.set_result(self._tensors)

    @frameless
    def wait(self, timeout: timedelta | None = None) -> bool:
        """Also settles the torch future: the worker's callback may not have run yet when
        the rankwise work is done, and ``wait(); get_future().value()`` must not fail."""
        try:
            return super().wait(timeout)
        finally:
            if self._inner.is_completed():
                self._settle()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future[Any]:
        return self._future


#: a ``then`` callback that fails the future chained on a failed one, in C++ (called from
#: C: no frame of rankwise's in what torch formats); a success passes the value on
_VALUE = operator.methodcaller("value")


class ChainedAsyncWork(AsyncWork):
    """An :class:`AsyncWork` whose torch future is chained on its own, for the backend
    under torch's ``ProcessGroup`` (``_c10d``). Why: ``fail_future``'s unwrap function lives
    on one Python wrapper of the future, and there torch's C++ hands the future out again
    in a new wrapper (2.15 wraps each ``Work``), whose ``wait()`` returned the ``_Failed``
    value instead of raising. A raising ``then`` callback fails the chained future in C++,
    so every wrapper of it raises (``Got the following error when running the callback:
    PeerFailure: ...``: ``rankwise.unwrap`` gives the exception back), and DDP's reducer
    raises it in backward. Made when first asked for (DDP's reducer asks, ``wait()``
    does not), so a call only waited on costs no second future."""

    _chained: Future[Any] | None = None

    def get_future(self) -> Future[Any]:
        chained = self._chained
        if chained is None:
            chained = self._chained = self._future.then(_VALUE)
        return chained


class RecvWork(_RankwiseBacked):
    """A pending receive: ``wait`` finishes it (bounded by the group's timeout)."""

    def source_rank(self) -> int:
        return int(self._inner.source_rank())  # type: ignore[attr-defined]

    def _source_rank(self) -> int:
        return self.source_rank()

    @frameless
    def get_future(self) -> Future[Any]:
        self.wait()
        return _future_of(self._tensors)
