"""Hooks a launched worker installs at ``import rankwise`` (when ``RANKWISE_LAUNCHED=1``).

Why: the launcher sees only an exit status.  To print *which* exception killed a rank, the
rank itself writes its uncaught exception to ``RANKWISE_ERROR_FILE`` (torchrun's error-file
idea), and to let users' ``finally`` blocks run when the launcher stops the group, SIGTERM
becomes an exception instead of an instant death.

Error file format (JSON, one object, written once -- the first uncaught exception wins
because later ones are usually consequences of it)::

    {"rank": 2, "exc_type": "ValueError", "message": "...", "traceback": "Traceback ...",
     "timestamp": 1700000000.123, "pid": 4242, "exc_mro": ["ValueError", "Exception", ...],
     "thread": "MainThread", "where": "train.py:41 in step"}

``where`` is the innermost frame of the user's code in the traceback (library frames
skipped, as call sites are): a rank that raised ``PeerFailure`` while waiting is listed with
the line it was waiting at, without its whole traceback.

``exc_mro`` lets the launcher tell secondary failures (``PeerFailure``, ``Terminated``)
from root causes without importing the user's classes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType
from typing import Any

from .. import settings

__all__ = ["Terminated", "as_raised", "install_worker_hooks", "one_line", "write_error_file"]

ERROR_FILE_ENV = "RANKWISE_ERROR_FILE"
_installed = False
_lock = threading.Lock()


class Terminated(SystemExit):
    """Raised in the main thread when the launcher sends SIGTERM; exits with status 143.

    A ``SystemExit`` subclass so ``except Exception`` in user code does not swallow it, while
    ``finally`` blocks and context managers still run.
    """

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def write_error_file(
    exc_type: type[BaseException],
    exc: BaseException,
    tb: TracebackType | None,
    path: str | None = None,
    thread_name: str | None = None,
) -> bool:
    """Write ``exc`` to the error file unless one was written already; return True if written.

    Created with O_EXCL so that of two threads failing at once only the first is recorded.
    """
    path = path or settings.text(ERROR_FILE_ENV)
    if not path:
        return False
    exc_type, exc = as_raised(exc_type, exc)
    record: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "-1")),
        "exc_type": exc_type.__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        "timestamp": time.time(),
        "pid": os.getpid(),
        "exc_mro": [c.__name__ for c in exc_type.__mro__],
        "thread": thread_name or threading.current_thread().name,
        "where": raised_at(tb),
    }
    peer = getattr(exc, "rank", None)
    if "PeerFailure" in record["exc_mro"] and isinstance(peer, int):
        record["peer"] = peer  # the rank it blames: the summary's root cause when it is here
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    return True


def as_raised(exc_type: type[BaseException], exc: BaseException
              ) -> tuple[type[BaseException], BaseException]:
    """The rankwise exception torch's C++ re-wrapped as a ``RuntimeError`` (DDP's reducer;
    ``rewrap.unwrap``), else ``exc``: what the rank is reported to have raised."""
    from ..rewrap import unwrap

    inner = unwrap(exc)
    return (exc_type, exc) if inner is exc else (type(inner), inner)


def raised_at(tb: TracebackType | None) -> str:
    """``train.py:41 in step``: the innermost frame of the user's code in ``tb`` ("" if none)."""
    from ..identity.callsite import stack_of  # not at import: the launcher itself never needs it

    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    site, _ = stack_of(tb.tb_frame)
    return "" if site.first is None else site.short


_ONE_LINE_MAX = 240  #: characters of a message shown in one line


def one_line(exc_type: type[BaseException] | str, exc: BaseException | str,
             where: str = "") -> str:
    """``ExcType: first line of the message [at file:line in fn]``: how a rank's failure is
    named in one line.  A long first line is cut at a word, marked with "...", never mid-word
    (a cut "op=SU" reads like a different op)."""
    name = exc_type if isinstance(exc_type, str) else exc_type.__qualname__
    lines = str(exc).strip().splitlines()
    text = f"{name}: {_cut(lines[0])}" if lines else name
    return f"{text} [raised at {where}]" if where else text


def _cut(line: str) -> str:
    if len(line) <= _ONE_LINE_MAX:
        return line
    head = line[:_ONE_LINE_MAX]
    space = head.rfind(" ")
    return (head[:space] if space > _ONE_LINE_MAX // 2 else head).rstrip(",;:") + " ..."


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def install_worker_hooks() -> None:
    """Chain the exception hooks to the error file and turn SIGTERM into ``Terminated``.

    Idempotent.  The SIGTERM handler is installed only from the main thread and only when
    SIGTERM still has its default disposition, so a user's own handler is never replaced.
    """
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True

    previous_hook = sys.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if not settings.text(ERROR_FILE_ENV):
            previous_hook(exc_type, exc, tb)
            return
        # the launcher prints the traceback once, in its summary (from the error file):
        # printed here too it appeared once per rank plus once there
        write_error_file(exc_type, exc, tb)
        exc_type, exc = as_raised(exc_type, exc)
        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"rank {rank}: {one_line(exc_type, exc, raised_at(tb))} (traceback: "
                         "in the launcher's summary)\n")
        sys.stderr.flush()

    sys.excepthook = excepthook

    previous_thread_hook = threading.excepthook

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and args.exc_type is not SystemExit:
            write_error_file(
                args.exc_type, args.exc_value, args.exc_traceback,
                thread_name=args.thread.name if args.thread else None,
            )
        previous_thread_hook(args)

    threading.excepthook = thread_hook

    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)
