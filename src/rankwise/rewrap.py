"""rankwise's exception back from the one torch's C++ made of it: :func:`unwrap`.

Why needed: where torch's C++ takes a failed call's result (DDP's reducer reads a bucket's
tensors out of the future ``torch._work.fail_future`` completed), a rankwise exception
raised there comes back to Python as ``RuntimeError("Cannot extract tensors from value:
PeerFailure: ...")`` with no ``__cause__``, so ``except rankwise.PeerFailure`` misses it.
Each exception handed to torch that way is noted here (:func:`note`, a short bounded list:
the failures of the last few calls), and ``unwrap`` finds it again by its message.

A rankwise error raised straight through torch's C++ (a backend method torch calls, as in
DDP's ``_broadcast_coalesced``) keeps its class, but leaves the seam without the frames it
was raised through (:func:`dropped`).

torch is given a bare copy (:func:`bare`): the same class, arguments and attributes, no
traceback, raised where no Python frame of rankwise's is on its way, so the text torch
builds of it ("At: ...", the frames pybind11 lists) names no rankwise-internal frame.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import DistError

__all__ = ["bare", "dropped", "frameless", "note", "unwrap"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

_noted: collections.deque[BaseException] = collections.deque(maxlen=16)
_lock = threading.Lock()


def bare(error: BaseException) -> BaseException:
    """``error`` without its traceback (its own object keeps it): the same class, args
    and attributes, so its message and ``except`` clauses are the same. Made without its
    ``__init__``, by the ``__new__`` of its layout: ``OSError``'s for an ``OSError``
    subclass (``DistTimeout`` is a ``TimeoutError``), which ``BaseException``'s refuses."""
    new = OSError.__new__ if isinstance(error, OSError) else BaseException.__new__
    copy = new(type(error), *error.args)
    copy.args = error.args  # an OSError subclass's ``__new__`` leaves them to ``__init__``
    copy.__dict__.update(getattr(error, "__dict__", {}))
    return copy


#: whether a bare ``raise`` re-raises with the exception's own ``__traceback__`` (3.11+;
#: 3.10 re-raises with the traceback it was caught with)
_OWN_TRACEBACK = sys.version_info >= (3, 11)


def dropped(error: BaseException) -> bool:
    """Drop the frames ``error`` was raised through, at a seam torch's code calls (a
    backend method, a ``Work``'s ``wait``): what the user sees then lists torch's frames
    and theirs, not rankwise's. True where a bare ``raise`` then re-raises it with no frame
    at all; else ``raise error`` adds the seam's one frame (Python 3.10)::

        except DistError as error:
            if dropped(error):
                raise
            raise error
    """
    error.__traceback__ = None
    return _OWN_TRACEBACK


def frameless(fn: _Fn) -> _Fn:
    """``fn`` as a seam (:func:`dropped`), for the methods off the per-call path (a
    ``Work``'s ``wait``); the per-call ones write the three lines out (no extra frame)."""
    @functools.wraps(fn)
    def seam(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DistError as error:
            if dropped(error):
                raise
            raise error  # noqa: TRY201 - Python 3.10: with this frame only
    return seam  # type: ignore[return-value]


def note(error: BaseException) -> None:
    """Remember ``error``, about to reach torch's C++ (``unwrap`` finds it again)."""
    with _lock:
        _noted.append(error)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def unwrap(exc: BaseException) -> BaseException:
    """The rankwise exception inside ``exc``; ``exc`` itself when there is none.

    ``exc`` may be rankwise's own (returned as is), carry it as its ``__cause__`` or
    ``__context__``, or be the ``RuntimeError`` torch's C++ made of it (DDP's reducer:
    ``Cannot extract tensors from value: PeerFailure: ...``), found by its message::

        try:
            loss.backward()
        except RuntimeError as exc:
            error = rankwise.unwrap(exc)
            if not isinstance(error, rankwise.PeerFailure):
                raise
            ...  # recover in place (docs/recovery.md)
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, DistError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    text = str(exc)
    with _lock:
        noted = list(_noted)
    for error in reversed(noted):
        line = _first_line(error)
        if line and f"{type(error).__name__}: {line}" in text:
            return error
    return exc
