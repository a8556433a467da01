"""``Future``: what ``Work.get_future()`` returns, the part of ``torch.futures.Future``
that communication hooks use (``wait``, ``value``, ``then``, ``done``).

Why not torch's own: torch is optional, and a rankwise ``Work`` completes on rankwise's
async thread, which torch's futures know nothing about. Callbacks run in the thread that
completes the future (as in torch), or at once when it is already complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument

__all__ = ["Future"]


class Future:
    """A value (or an error) that arrives later, with callbacks chained by ``then``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def set_result(self, value: Any) -> None:
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._complete(None, error)

    def _complete(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                raise InvalidArgument("this Future is already complete; it takes one result")
            self._value, self._error = value, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def wait(self) -> Any:
        """Block until complete; return the value or raise the error. The operation behind
        it is bounded by its group's timeout, so this wait is too."""
        self._done.wait()
        return self.value()

    def value(self) -> Any:
        if not self._done.is_set():
            raise InvalidArgument("Future.value() called before the future completed; "
                                  "call wait() (or read it inside a then() callback)")
        if self._error is not None:
            raise self._error
        return self._value

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A new future holding ``callback(self)``'s return value (or what it raised)."""
        chained = Future()

        def run(done: Future) -> None:
            try:
                result = callback(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the chained future
                chained.set_exception(exc)
            else:
                chained.set_result(result)

        self.add_done_callback(run)
        return chained

    def __repr__(self) -> str:
        return f"<rankwise.Future {'done' if self.done() else 'pending'}>"
