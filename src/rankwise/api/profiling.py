"""Communication events for torch's profiler: ``rankwise:<op>``, as gloo's ``gloo:<op>``.

A user profiling a job with ``torch.profiler`` sees every collective and p2p call, with its
input shapes and ``is_async`` set, whether the job calls ``torch.distributed`` on backend
``"rankwise"`` or ``import rankwise as dist``. Free without a profiler: :func:`on` is one
call into torch (about 50 ns) and only once torch has been imported by someone else;
rankwise never imports torch for this.

Why events end on another thread: torch's profiler marks an event async when it ends on
another thread than it started on (``_parse_kineto_results``), which is how gloo's events
end (on gloo's worker thread, where its calls run). A call takes its one route under a
profiler too (``api.path``): the ``Profiled`` observer ends its event, on the async
worker for an async call, and through :class:`_Finisher`'s thread where it ends on the
caller's (a synchronous call, point-to-point calls, the torch backend's events around
several calls).

Nesting: the torch backend opens one event for a call it splits into several rankwise calls
(``all_reduce_coalesced``, ``all_gather_coalesced``); the calls inside add none, so one
user call is one event, as on gloo.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Event", "begin", "event", "on", "recording"]

#: rankwise's op names where gloo's event names differ
_GLOO_NAMES = {"all_to_all_single": "all_to_all"}

_local = threading.local()


def on() -> bool:
    """Whether a torch profiler records now (False while torch is not imported)."""
    return recording() and not getattr(_local, "inside", False)


def _first_recording() -> bool:
    """``recording`` until torch's check is bound: binds it once torch is imported."""
    global recording
    if "torch" not in sys.modules:
        return False
    try:
        from torch._C._autograd import _profiler_enabled
    except ImportError:  # torch half-imported (we are inside its import): not yet
        return False
    recording = _profiler_enabled
    return bool(_profiler_enabled())


#: whether a torch profiler records now, on any thread: torch's own check (one C call)
#: once bound (~0.05 us). The hot path asks ``recording() and on()``: no Python call of
#: its own per collective while no profiler records
recording: Callable[[], bool] = _first_recording


def _tensors(values: Any) -> list[Any]:
    """The torch tensors among ``values`` (lists flattened): what the event's shapes are
    read from (numpy arrays have none to give)."""
    torch = sys.modules["torch"]
    out: list[Any] = []
    for v in values or ():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


class _Finisher:
    """One daemon thread that completes the futures events end on (module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="rankwise-profiler",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            future, done = self._jobs.get()
            try:
                future.set_result(None)
            finally:
                done.set()

    def end(self, future: Any) -> None:
        done = threading.Event()
        self._jobs.put((future, done))
        done.wait(5.0)  # bounded: a stuck profiler must not stop communication


_finisher: _Finisher | None = None
_finisher_lock = threading.Lock()


def _the_finisher() -> _Finisher:
    global _finisher
    with _finisher_lock:
        if _finisher is None:
            _finisher = _Finisher()
        return _finisher


class Event:
    """One ``rankwise:<op>`` record, begun now; :meth:`end` once the call is done.

    torch's own async events are made this way (``record_function`` with its end tied to
    a future): the record takes the input tensors (their shapes), and completing the
    future on another thread ends it there, with the profiler's thread-local state carried
    over (ending the record directly from a bare thread loses its end: torch then shows
    it unfinished, lasting until the profiler stops)."""

    __slots__ = ("_future", "_thread")

    def __init__(self, op: str, inputs: Any) -> None:
        import torch
        from torch._C._autograd import _record_function_with_args_enter

        name = f"rankwise:{_GLOO_NAMES.get(op, op)}"
        record = _record_function_with_args_enter(name, *_tensors(inputs))
        self._future: Any = torch.futures.Future()
        torch.ops.profiler._call_end_callbacks_on_jit_fut(record, self._future)
        self._thread = threading.get_ident()

    def end(self) -> None:
        future, self._future = self._future, None
        if future is None:
            return
        if threading.get_ident() != self._thread:
            future.set_result(None)
        else:
            _the_finisher().end(future)


def begin(op: str, inputs: Any) -> Event | None:
    """An event for ``op`` if a profiler records (and no outer event covers this call)."""
    return Event(op, inputs) if on() else None


@contextmanager
def event(op: str, inputs: Any) -> Iterator[None]:
    """One event around a call that makes several rankwise calls (which add none)."""
    ev = begin(op, inputs)
    if ev is None:
        yield
        return
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = False
        ev.end()
