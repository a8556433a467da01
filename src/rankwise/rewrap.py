"""rankwise's exception back from the one torch's C++ made of it: :func:`unwrap`.

Why needed: where torch's C++ takes a failed call's result (DDP's reducer reads a bucket's
tensors out of the future ``torch._work.fail_future`` completed), a rankwise exception
raised there comes back to Python as ``RuntimeError("Cannot extract tensors from value:
PeerFailure: ...")`` with no ``__cause__``, so ``except rankwise.PeerFailure`` misses it.
Each exception handed to torch that way is noted here (:func:`note`, a short bounded list:
the failures of the last few calls), and ``unwrap`` finds it again by its message.

torch is given a bare copy (:func:`bare`): the same class, arguments and attributes, no
traceback, raised where no Python frame of rankwise's is on its way, so the text torch
builds of it ("At: ...", the frames pybind11 lists) names no rankwise-internal frame.
"""

from __future__ import annotations

import collections
import threading

from .errors import DistError

__all__ = ["bare", "note", "unwrap"]

_noted: collections.deque[BaseException] = collections.deque(maxlen=16)
_lock = threading.Lock()


def bare(error: BaseException) -> BaseException:
    """``error`` without its traceback (its own object keeps it): the same class, args
    and attributes, so its message and ``except`` clauses are the same."""
    copy = BaseException.__new__(type(error), *error.args)
    copy.__dict__.update(getattr(error, "__dict__", {}))
    return copy


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
