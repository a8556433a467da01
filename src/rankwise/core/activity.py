"""What this rank is doing now and what it did last, in the words reports use.

Why its own piece: the who-is-where reports, the departure and timeout messages and the
deadlock probe all need "which call is this rank in, at which line" — and the hot path
must only store the facts (an ``Activity``, the last call) and never format
them; formatting happens here, on the slow path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..identity.callsite import UNKNOWN, CallSite

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Activity", "CallLog"]


class Activity:
    """What this rank is doing now, for who-is-where reports.

    A plain class whose defaults live on the class, not a dataclass: two are made per
    call (the call's, then "user code" after it), and the hot path sets only the fields
    that differ from the defaults (``api.observers.WhoIsWhere``, ``Activity.idle``): a 12-field
    ``__init__`` cost ~0.55 us each. Engines set ``waiting_for``, ``patient``,
    ``enqueued`` and ``engine`` on the current one in place."""

    op: str = ""
    group: int = 0
    seq: int = 0
    site: CallSite = UNKNOWN
    since: float = 0.0
    waiting_for: int = -1  #: global rank this rank blocks on, -1 when none (or any)
    kind: str = "collective"  #: "collective" or "recv" (a blocking point-to-point wait)
    tag: int = 0
    patient: bool = False  #: waiting on purpose (rank_zero_first's followers): no warning
    call: str = ""  #: the call's description, when known without formatting on the hot path
    #: when a foreign engine (torch's gloo, NCCL) took the call's data op (time.time(); 0:
    #: not handed over): "enqueued, not finished" differs from "never called it"
    enqueued: float = 0.0
    engine: str = ""  #: the foreign engine that holds the op

    def __init__(self, op: str = "", group: int = 0, seq: int = 0, site: CallSite = UNKNOWN,
                 since: float | None = None, waiting_for: int = -1, kind: str = "collective",
                 tag: int = 0, patient: bool = False, call: str = "", enqueued: float = 0.0,
                 engine: str = "") -> None:
        self.op, self.group, self.seq, self.site = op, group, seq, site
        self.since = time.time() if since is None else since
        self.waiting_for, self.kind, self.tag, self.patient = waiting_for, kind, tag, patient
        self.call, self.enqueued, self.engine = call, enqueued, engine

    @classmethod
    def idle(cls, since: float) -> Activity:
        """In user code since ``since``."""
        a = _new(cls)
        a.since = since
        return a

    def __repr__(self) -> str:
        return (f"Activity(op={self.op!r}, group={self.group}, seq={self.seq}, "
                f"site={self.site.short!r}, since={self.since}, kind={self.kind!r}, "
                f"waiting_for={self.waiting_for})")


_new = object.__new__


class CallLog:
    """This rank's current and last call, described on demand."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._last: Any = None  #: the last finished ``engines.base.Call``
        #: the activity between calls, one for all of them (``since`` set at each end):
        #: readers look at ``op`` first, and an idle one has none
        self._idle = Activity()

    @property
    def idle(self) -> Activity:
        """The activity between calls (the one ``call_done`` makes current)."""
        return self._idle

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
        idle = self._idle
        idle.since = now
        comm.doing = idle
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
