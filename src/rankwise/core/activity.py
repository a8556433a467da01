"""What this rank is doing now and what it did last, in the words reports use.

Why its own piece: the who-is-where reports, the departure and timeout messages and the
deadlock probe all need "which call is this rank in, at which line" — and the hot path
must only store the facts (an ``Activity``, the last call) and never format
them; formatting happens here, on the slow path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..identity.callsite import UNKNOWN, CallSite

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Activity", "CallLog"]


@dataclass(slots=True)
class Activity:
    """What this rank is doing now, for who-is-where reports."""

    op: str = ""
    group: int = 0
    seq: int = 0
    site: CallSite = UNKNOWN
    since: float = field(default_factory=time.time)
    waiting_for: int = -1  #: global rank this rank blocks on, -1 when none (or any)
    kind: str = "collective"  #: "collective" or "recv" (a blocking point-to-point wait)
    tag: int = 0
    patient: bool = False  #: waiting on purpose (rank_zero_first's followers): no warning
    call: str = ""  #: the call's description, when known without formatting on the hot path
    #: when a foreign engine (torch's gloo, NCCL) took the call's data op (time.time(); 0:
    #: not handed over): "enqueued, not finished" differs from "never called it"
    enqueued: float = 0.0
    engine: str = ""  #: the foreign engine that holds the op


class CallLog:
    """This rank's current and last call, described on demand."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._last: Any = None  #: the last finished ``engines.base.Call``

    @property
    def last_call(self) -> str:
        """This rank's last finished collective, formatted on demand (slow path only)."""
        call = self._last
        if call is None:
            return ""
        return f"{call.describe()} (#{call.seq} of {call.group.name})"

    def call_done(self, call: Any) -> None:
        """A collective finished (or failed): remember it, go back to "user code"."""
        now = time.time()
        call.finished = now
        self._last = call
        comm = self._comm
        comm.activity = Activity(since=now)
        if comm.tracer is not None:
            comm.tracer.collective(call.group, call)

    def doing(self) -> str:
        """``all_reduce #5 at data.py:12 in load`` — what this rank waits in now."""
        a = self._comm.activity
        if not a.op:
            return ""
        if a.kind == "recv":
            return f"recv from rank {a.waiting_for} (tag {a.tag}) at {a.site.short}"
        return f"{self.call_of(a)} #{a.seq} (group {a.group}) at {a.site.short}"

    def call_of(self, a: Activity) -> str:
        """The description of the collective ``a`` is in (``barrier(name='x')``)."""
        if a.call:
            return a.call
        group = self._comm.groups.get(a.group)
        record = group.record_of(a.seq) if group is not None else None
        if record is None:
            return f"{a.op}()"
        return str(record.describe(site=False))
