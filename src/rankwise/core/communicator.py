"""One process's connection to the rest of the job: the parts, put together.

The communicator sits between the API and the transport. It is the transport's frame
handler (collective and point-to-point frames go to the router, control frames become
state), and it composes one part per job, each in its own module:

- ``Sender`` (``core.sending``): frames out, call-site texts once per peer;
- ``Waiter`` (``core.waiting``): every blocking wait, its warnings and its timeout;
- ``Mismatches`` (``core.mismatches``): ranks that made different calls, explained;
- ``Departures`` (``core.departures``): aborts, goodbyes, dead peers, and leaving;
- ``CallLog`` (``core.activity``): what this rank is in now and did last, in words;
- ``WhereService`` and ``DeadlockWatch`` (``checks``): who-is-where and deadlocks.

Callers see one object with the methods they always used (``comm.wait``,
``comm.send_frame``, ``comm.goodbye``, ...): each is the part's own bound method, so
the hot path pays no extra call for the composition.

Diagnosis lives on the slow path only (docs/design.md, "Diagnosis, cheaply"); the fast path
pays for none of it beyond a clock read per wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .. import settings
from ..checks.deadlock import blocked_state
from ..checks.prober import DeadlockWatch
from ..checks.report import build_report, format_where
from ..checks.stragglers import StragglerBook
from ..checks.where import WhereService
from ..identity.callsite import CallSite
from ..transport.base import Transport
from ..wire.frames import CHECK_ENTRY, Frame, Kind, decode_checks
from .activity import Activity, CallLog
from .departures import Departures
from .heartbeat import Heartbeat
from .mismatches import Mismatches
from .port import ControlPlane
from .router import Pending, Router
from .sending import Sender
from .waiting import Waiter

__all__ = ["Activity", "Communicator"]

_COLL = int(Kind.COLL)


def _env_seconds(name: str, default: float) -> float:
    return settings.number(name, default)


class Communicator:
    """Owns the transport and router of this process for the lifetime of the job."""

    def __init__(self, rank: int, world_size: int, transport: Transport) -> None:
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.closed = False
        #: what this rank does now: an ``Activity``, or the ``engines.base.Call`` in
        #: progress standing for its own (the device hot path: no object per call), whose
        #: ``Activity`` is made when asked (``activity``). Who-is-where writes
        #: (``waiting_for``, ``enqueued``, ``engine``) go here: both have those fields.
        self.doing = Activity()
        #: every group this process is a member of, by id (ProcessGroup registers itself)
        self.groups: dict[int, Any] = {}
        #: call-site texts the peers defined (SITE frames), by peer and site id
        self.peer_sites: dict[int, dict[int, CallSite]] = {r: {} for r in range(world_size)}
        #: engines that see peers' calls without frames (shared memory) describe a peer's
        #: latest call here, by global rank ("" when they have not seen one)
        self.peer_call_sources: list[Callable[[int], str]] = []
        #: the thread that made this communicator (the user's): a who-is-where answer
        #: reads its stack to say where a rank that is not in a rankwise call is busy
        self.user_thread = threading.get_ident()
        self.site_lookup: Callable[[int, int], CallSite | None] | None = None
        #: seconds a wait may last before this rank asks everyone where they are
        self.warn_after = _env_seconds("RANKWISE_WARN_AFTER", 30.0)
        #: RANKWISE_TRACE's timeline and RANKWISE_DUMP's post-mortem writer, attached by
        #: whoever builds the job (``diagnosis.recorders``); None when not asked for
        self.tracer: Any = None
        self.dumper: Any = None

        self.calls = CallLog(self)
        self.stragglers = StragglerBook(self)  # reads the histories; looks at user_thread
        self.sender = Sender(self)
        self.departures = Departures(self)
        self.mismatches = Mismatches(self)
        self.waiter = Waiter(self)
        self.router = Router(self.mismatches.on_mismatch, self.departures.on_protocol_error)
        self.router.resume = transport.resume
        self.where = WhereService(self)
        self.report_provider: Callable[[], dict[str, Any]] = self._report
        #: asks whether every rank is blocked for good, from a wait's first second on
        #: (through the job's prober: ``checks.prober``)
        self.deadlock = DeadlockWatch(self)
        #: what engines see of all this (``core.port``)
        self.port = ControlPlane(self)

        # the parts' methods, as callers have always called them on the communicator
        self.send = self.sender.send
        self.send_frame = self.sender.send_frame
        self.wait = self.waiter.wait
        self.warn_slow = self.waiter.warn_slow
        self.await_diagnosis = self.mismatches.await_diagnosis
        self.tell_mismatch = self.mismatches.tell
        self.broadcast_abort = self.departures.broadcast_abort
        self.relay_of = self.departures.relay_of
        self.as_of_now = self.departures.as_of_now
        self.goodbye = self.departures.goodbye
        self.on_peer_lost = self.departures.on_peer_lost
        self.on_fatal = self.departures.on_fatal
        self.call_done = self.calls.call_done
        self.call_of = self.calls.call_of
        self.last_reports = self.departures.last_reports
        self._last_seen = self.departures.last_seen
        self.heartbeat = Heartbeat.create(self)  # before the first beat can arrive
        transport.start(self)
        if self.heartbeat is not None:
            self.heartbeat.start()

    @property
    def activity(self) -> Activity:
        """What this rank does now, for reports."""
        doing: Activity = self.doing
        return doing

    @activity.setter
    def activity(self, activity: Activity) -> None:
        self.doing = activity

    @property
    def last_call(self) -> str:
        """This rank's last finished collective, formatted on demand (slow path only)."""
        return self.calls.last_call

    # --- FrameHandler ----------------------------------------------------------------------

    def on_header(self, frame: Frame) -> tuple[memoryview | bytearray | None, object]:
        if frame.kind == _COLL:
            self._last_seen[frame.src] = frame
            return self.router.coll_header(frame)
        if frame.kind in (Kind.P2P, Kind.OBJ):
            return self.router.on_header(frame)
        buf = bytearray(frame.payload_len)
        return buf, buf

    def on_payload(self, frame: Frame, token: object) -> None:
        if type(token) is Pending:  # the common case: it landed in a posted receive
            token.finish(frame)
        elif frame.kind in (Kind.COLL, Kind.P2P, Kind.OBJ):
            self.router.on_payload(frame, token)  # type: ignore[arg-type]
        else:  # control frames: the token is the bytearray we returned in on_header
            assert isinstance(token, bytearray)
            self.on_control(frame, bytes(token))

    def on_control(self, frame: Frame, payload: bytes) -> None:
        if frame.kind == Kind.SITE:
            text = payload.decode("utf-8", "replace")
            self.peer_sites[frame.src][frame.site] = CallSite.decode(frame.site, text)
        elif frame.kind == Kind.ABORT:
            self.departures.on_abort(frame.src, payload)
        elif frame.kind == Kind.BYE:
            self.departures.on_bye(frame.src, payload)
        elif frame.kind == Kind.WHERE:
            self.where.answer(frame)
        elif frame.kind == Kind.HERE:
            self.where.on_here(frame, payload)
        elif frame.kind == Kind.BLOCKED:
            self.deadlock.on_note(frame.src, frame.tag)
        elif frame.kind == Kind.BEAT:
            if self.heartbeat is not None:
                self.heartbeat.on_beat(frame.src, payload)
        elif frame.kind == Kind.CHECKS:
            if len(payload) >= CHECK_ENTRY.size:  # the latest call the peer told of
                last = decode_checks(frame, payload[-CHECK_ENTRY.size:])
                self._last_seen[frame.src] = last[0]
            # each as the frame it stands for: most are settled in one pass, the rest
            # (early, mismatched) take the path of a frame that came alone
            for f in self.router.checks.take(frame, payload):
                target, token = self.on_header(f)
                if target is not None:
                    self.on_payload(f, token)

    # --- who is where -----------------------------------------------------------------------

    def _report(self) -> dict[str, Any]:
        report = build_report(self)
        report["blocked"] = blocked_state(self)  # what the deadlock detector compares
        return report

    def where_is_everyone(self, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
        """Every rank's state report (see ``checks.where``)."""
        return self.where.ask_everyone(timeout)

    def where_table(self, headline: str, timeout: float = 2.0) -> str:
        """Ask every rank where it is and format one table (the slow path)."""
        return format_where(self.where_is_everyone(timeout), headline)
