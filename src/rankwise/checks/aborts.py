"""What an ABORT frame says, both ways: the exception a peer's failure becomes here, and
the kind a failure is sent as. One table, so the two directions cannot drift apart.

An ABORT's payload is JSON: ``kind`` ("exception", "mismatch", "deadlock"), the ``rank``
where the failure started, its ``message``, and optionally its ``traceback``, ``last``
collective, ``report`` and ``relayed_by`` (the rank that passed on a failure it only
suffered). Payloads are untrusted bytes: every field is read defensively and bounded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CollectiveMismatch, DeadlockError, DistError, PeerFailure, PeerTimeout

__all__ = ["AbortInfo", "abort_error", "kind_of", "parse_abort"]

_MESSAGE_MAX = 200_000
_REPORT_MAX = 100_000
_TRACEBACK_MAX = 50_000


@dataclass(frozen=True)
class AbortInfo:
    """A parsed ABORT, as received by rank ``me`` from rank ``src``."""

    raw: dict[str, Any]
    src: int
    me: int
    doing: str  #: what ``me`` waits in now ("" if nothing), for the message

    @property
    def kind(self) -> str:
        return str(self.raw.get("kind", "exception"))

    @property
    def origin(self) -> int:
        rank = str(self.raw.get("rank", self.src))
        return int(rank) if rank.isdigit() else self.src

    @property
    def message(self) -> str:
        return str(self.raw.get("message", ""))[:_MESSAGE_MAX]

    @property
    def traceback(self) -> str:
        return str(self.raw.get("traceback", ""))[:_TRACEBACK_MAX]

    @property
    def report(self) -> str:
        """The who-is-where table of a peer that timed out ("" if it sent none)."""
        return str(self.raw.get("report", ""))[:_REPORT_MAX]

    @property
    def last(self) -> str:
        return str(self.raw.get("last", ""))

    def noted(self, how: str) -> str:
        """The message plus who found it and who is told."""
        return f"{self.message}\n({how} rank {self.origin}; reported to rank {self.me})"


def parse_abort(payload: bytes) -> dict[str, Any]:
    """The payload's JSON object; an unreadable one becomes an anonymous exception."""
    try:
        info = json.loads(payload.decode("utf-8", "replace"))
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {"kind": "exception", "message": "(unreadable abort message)"}
    return info


#: failures every rank of the job raises alike: a peer that dies of one is not the cause
_LEARNED: tuple[type[DistError], ...] = (CollectiveMismatch, DeadlockError)


def _deadlock(a: AbortInfo) -> DistError:
    calls = a.raw.get("ranks")
    exc = DeadlockError(a.noted("detected by"),
                        {int(r): str(c) for r, c in calls.items() if str(r).isdigit()}
                        if isinstance(calls, dict) else None)
    seen = a.raw.get("reports")
    if isinstance(seen, dict):
        exc.reports = {int(r): rep for r, rep in seen.items()
                       if str(r).isdigit() and isinstance(rep, dict)}
    return exc


def _mismatch(a: AbortInfo) -> DistError:
    return CollectiveMismatch(a.noted("detected by"))


def _exception(a: AbortInfo) -> DistError:
    if a.raw.get("relayed_by") is not None:
        return PeerFailure(f"{a.message}\n(passed on by rank {a.src}, which left after it)",
                           rank=a.origin, remote_traceback=a.traceback, last_collective=a.last)
    for cls in _LEARNED:
        prefix = f"{cls.__name__}: "
        if a.message.startswith(prefix):
            # the peer died of a job-wide failure it learned about (a mismatch, a deadlock)
            # and its exit news can overtake the original's: the cause is that failure
            return cls(a.message[len(prefix):]
                       + f"\n(raised on rank {a.origin}; reported to rank {a.me})")
    tb = a.traceback
    message = (f"rank {a.origin} failed: {a.message}\n"
               f"its last collective: {a.last or 'none'}\n"
               + (f"rank {a.me} was in {a.doing}\n" if a.doing else "")
               + (f"its traceback:\n{tb}" if tb else ""))
    if a.doing and a.message.startswith("DistTimeout: "):
        # the peer's deadline passed first while this rank waited too: its timeout as well
        # (a rank that was computing learns of a peer's failure: a plain PeerFailure)
        return PeerTimeout(message, rank=a.origin, remote_traceback=tb, last_collective=a.last,
                           report=a.report)
    return PeerFailure(message, rank=a.origin, remote_traceback=tb, last_collective=a.last)


#: kind on the wire -> the class it is raised as here, and how to build it; an unknown
#: kind is an exception (a newer peer's kind must not crash an older receiver)
_KINDS: tuple[tuple[str, type[DistError], Callable[[AbortInfo], DistError]], ...] = (
    ("mismatch", CollectiveMismatch, _mismatch),
    ("deadlock", DeadlockError, _deadlock),
    ("exception", PeerFailure, _exception),
)


def abort_error(info: AbortInfo) -> DistError:
    """The exception rank ``info.me`` raises for the peer's ABORT."""
    for kind, _, build in _KINDS:
        if kind == info.kind:
            return build(info)
    return _exception(info)


def kind_of(failure: BaseException) -> str:
    """The kind ``failure`` is sent as (the inverse of ``abort_error``)."""
    for kind, cls, _ in _KINDS:
        if isinstance(failure, cls):
            return kind
    return "exception"
