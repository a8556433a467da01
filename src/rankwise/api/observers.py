"""The checks and records around every call, as one layer of observers around any engine.

Why a layer: who-is-where, the trace, the profiler's events and the ring check must be
the same for every engine and every way in, and no engine should know of them (torchft's
``ProcessGroupWrapper``, torchcomms' pre/post hooks). ``api.path`` runs the phases
(``engines.base.Observers``): ``before`` -> the engine's op -> ``enqueued`` (engines
whose data rankwise does not own report it) -> ``after`` or ``failed``.

A new check is one class with the four hooks (``engines.base.Observer``) and one line in
``_members``; the set is built once per group and engine and kept on the group.
docs/design.md, "One call path".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.activity import Activity
from ..engines.base import Call, Engine, Observer, Observers
from ..wire.frames import Op

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["Profiled", "WhoIsWhere", "observed"]

#: ``Op(code).name`` is an enum lookup and property (~0.3 us); this runs once per call
_OP_NAMES = {int(op): op.name for op in Op}
_new = object.__new__


class WhoIsWhere(Observer):
    """What this rank is in now (``Communicator.doing``, read by who-is-where reports and
    the deadlock probe), then its history and trace span (``CallLog.call_done``)."""

    def __init__(self, group: ProcessGroup) -> None:
        self._comm = group.comm
        #: history, trace span, back to "user code": the call log's own, no layer here
        self.after = self.failed_call = group.comm.call_done  # type: ignore[method-assign]

    def before(self, call: Call) -> None:
        # an ``Activity`` with only the call's fields set (the rest are the class's
        # defaults): its ``__init__`` sets twelve (docs in ``core.activity``)
        a = _new(Activity)
        a.op, a.group, a.seq, a.site, a.since = (_OP_NAMES[call.fp.op], call.group.id,
                                                 call.seq, call.site, call.started)
        self._comm.doing = a

    def failed(self, call: Call, exc: BaseException) -> None:
        self.failed_call(call)


class Profiled(Observer):
    """The profiler's event of the call (``api.profiling``; ``launch`` starts it, as the
    call's shapes are known there), ended when the call ends here."""

    def after(self, call: Call) -> None:
        event: Any = call.event
        if event is not None:
            event.end()

    def failed(self, call: Call, exc: BaseException) -> None:
        self.after(call)


def _members(group: ProcessGroup, engine: Engine) -> tuple[Observer, ...]:
    """The observers of ``group``'s calls on ``engine``, first opened first: the one
    place a new check is added."""
    members: list[Observer] = [WhoIsWhere(group)]
    caps = engine.caps
    if caps.ring is not None and caps.ring != "off":  # data rankwise does not own
        # one ring per declaring engine: a wrapper (``Staged``, ``DevicePair``) shares
        # its inner engine's ``caps``, and with them its ring
        key = ("ring", id(caps))
        kept = group.observers.get(key)
        if kept is not None and kept[0] is caps:
            check = kept[1]
        else:
            check = group.port.fingerprints(group, caps.ring)
            group.observers[key] = (caps, check)
            if caps.held is not None and check.mode != "off":
                caps.held.append(check.flush)
        if check.mode != "off":  # a group of one has no ring
            members.append(check)
    return tuple(members)


def observed(group: ProcessGroup, engine: Engine, profiled: bool) -> Observers:
    """``group``'s observers on ``engine`` (with the profiler's while one records), made
    on the first call and kept."""
    key: Any = engine if not profiled else (engine, Profiled)
    obs = group.observers.get(key)
    if obs is None:
        if profiled:
            base = observed(group, engine, False)
            obs = Observers((*base.members, Profiled()), base.by_path)
        else:
            obs = Observers(_members(group, engine), engine.caps.ring is None)
        group.observers[key] = obs
    return obs
