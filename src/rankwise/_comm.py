"""One process's connection to the rest of the job: sending, receiving, and failing loudly.

The communicator sits between the API and the transport. It fills frame headers with
the call's fingerprint, sends each call site's text once per connection, turns arriving
control frames into state (a peer's abort, a clean goodbye, a "where are you?"), and
makes sure that any failure anywhere becomes an exception in every waiting thread of
every rank at once — never a silent wait until the timeout.

Diagnosis lives on the slow path only (DESIGN.md, "Diagnosis, cheaply"): a wait that
passes ``RANKWISE_WARN_AFTER`` seconds asks every rank where it is and logs one table; a
timeout raises ``DistTimeout`` carrying that table; a mismatch gathers every rank's
recent history (bounded, ~2 s) and names the earliest collective where the ranks'
call stacks diverged. The fast path pays for none of it beyond a clock read per wait.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._callsite import UNKNOWN, CallSite, enabled
from ._router import Fingerprint, Pending, Router
from ._wire import Frame, Kind, decode_checks, encode_header
from .checks.aborts import AbortInfo, abort_error, kind_of, parse_abort
from .checks.calls import describe_call, mismatch_advice
from .checks.deadlock import DeadlockWatch, blocked_state
from .checks.report import (
    build_report,
    format_where,
    mismatch_report,
    rank_list,
    reported_shape,
    stalled_mismatch,
)
from .checks.where import WhereService
from .errors import (
    CollectiveMismatch,
    DistError,
    DistNetworkError,
    DistTimeout,
    PeerFailure,
)
from .transport.base import Transport

__all__ = ["Activity", "Communicator"]

log = logging.getLogger("rankwise")
_COLL = int(Kind.COLL)

def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


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


class Communicator:
    """Owns the transport and router of this process for the lifetime of the job."""

    def __init__(self, rank: int, world_size: int, transport: Transport) -> None:
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.router = Router(self._on_mismatch, self._on_protocol_error)
        self.router.resume = transport.resume
        self._sites_sent: dict[int, set[int]] = {r: set() for r in range(world_size)}
        self.peer_sites: dict[int, dict[int, CallSite]] = {r: {} for r in range(world_size)}
        self._bye: dict[int, str] = {}
        #: the who-is-where report a peer sent with its mismatch abort: it may have left
        #: before our own question reached it
        self.last_reports: dict[int, dict[str, Any]] = {}
        self._last_seen: dict[int, Frame] = {}  #: last collective frame from each peer
        #: engines that see peers' calls without frames (shared memory) describe a peer's
        #: latest call here, by global rank ("" when they have not seen one)
        self.peer_call_sources: list[Callable[[int], str]] = []
        self.activity = Activity()
        #: the thread that made this communicator (the user's): a who-is-where answer
        #: reads its stack to say where a rank that is not in a rankwise call is busy
        self.user_thread = threading.get_ident()
        self._last_record: tuple[Any, str] | None = None
        #: every group this process is a member of, by id (ProcessGroup registers itself)
        self.groups: dict[int, Any] = {}
        self.report_provider: Callable[[], dict[str, Any]] = self._report
        self.where = WhereService(self)
        self.site_lookup: Callable[[int, int], CallSite | None] | None = None
        self.closed = False
        #: seconds a wait may last before this rank asks everyone where they are
        self.warn_after = _env_seconds("RANKWISE_WARN_AFTER", 30.0)
        #: asks whether every rank is blocked for good, from a wait's first second on
        self.deadlock = DeadlockWatch(self)
        self._diagnosing = False
        self._diag_lock = threading.Lock()
        self._diag_done: threading.Event | None = None
        self.tracer: Any = None
        trace_dir = os.environ.get("RANKWISE_TRACE")
        if trace_dir:
            from .diagnosis.trace import Tracer

            self.tracer = Tracer(trace_dir, rank)
        self.dumper: Any = None  #: RANKWISE_DUMP's post-mortem writer (diagnosis.dump)
        dump_dir = os.environ.get("RANKWISE_DUMP")
        if dump_dir:
            from .diagnosis.dump import Dumper

            self.dumper = Dumper(dump_dir, self)
        transport.start(self)

    # --- calls (hot path: no formatting here) ----------------------------------------------

    @property
    def last_call(self) -> str:
        """This rank's last finished collective, formatted on demand (slow path only)."""
        if self._last_record is None:
            return ""
        record, group_name = self._last_record
        if isinstance(record, _Text):
            return record.text
        return f"{record.describe()} (#{record.seq} of {group_name})"

    @last_call.setter
    def last_call(self, value: str) -> None:  # kept for callers that set a text
        self._last_record = None if not value else (_Text(value), "")

    def call_done(self, group: Any, record: Any) -> None:
        """A collective finished (or failed): remember it, go back to "user code"."""
        now = time.time()
        record.finished = now
        self._last_record = (record, group.name)
        self.activity = Activity(since=now)
        if self.tracer is not None:
            self.tracer.collective(group, record)

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

    def on_fatal(self, exc: DistError) -> None:
        """The transport's reader failed unexpectedly: fail every waiter with ``exc`` and
        tell the peers, which would otherwise wait for this rank until their timeout."""
        self._fail_loudly(exc)

    def _on_protocol_error(self, src: int, message: str) -> None:
        self._fail_loudly(DistNetworkError(message))

    def _fail_loudly(self, exc: DistError) -> None:
        if self.closed:
            return
        first = self.router.failure is None
        self.router.fail_all(exc)
        if first:
            self.broadcast_abort({"kind": "exception", "rank": self.rank,
                                  "message": f"{type(exc).__name__}: {exc}"}, background=True)

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        if self.closed:
            return
        bye = self._bye.get(rank)
        if bye is not None:
            self.router.fail_peer(rank, self._departed_error(rank, bye))
            return
        mine = self._doing()
        exc = PeerFailure(
            f"rank {rank} died: its connection to rank {self.rank} was lost "
            f"({reason or 'closed'}) without a goodbye — the process crashed, was killed "
            f"(SIGKILL, out of memory), or its machine went away. Last collective seen from "
            f"rank {rank}: {self._last_from(rank) or 'none'}"
            + (f"; rank {self.rank} was in {mine}" if mine else ""),
            rank=rank, last_collective=self._last_from(rank),
        )
        self.router.fail_all(exc)

    # --- control frames -------------------------------------------------------------------

    def on_control(self, frame: Frame, payload: bytes) -> None:
        if frame.kind == Kind.SITE:
            text = payload.decode("utf-8", "replace")
            self.peer_sites[frame.src][frame.site] = CallSite.decode(frame.site, text)
        elif frame.kind == Kind.ABORT:
            self._on_abort(frame.src, payload)
        elif frame.kind == Kind.BYE:
            where = payload.decode("utf-8", "replace")[:2000]
            self._bye[frame.src] = where
            self.router.fail_peer(frame.src, self._departed_error(frame.src, where))
        elif frame.kind == Kind.WHERE:
            self.where.answer(frame)
        elif frame.kind == Kind.HERE:
            self.where.on_here(frame, payload)
        elif frame.kind == Kind.CHECKS:
            for f in decode_checks(frame, payload):  # each as the frame it stands for
                target, token = self.on_header(f)
                if target is not None:
                    self.on_payload(f, token)

    def _doing(self) -> str:
        """``all_reduce #5 at data.py:12 in load`` — what this rank waits in now."""
        a = self.activity
        if not a.op:
            return ""
        if a.kind == "recv":
            return f"recv from rank {a.waiting_for} (tag {a.tag}) at {a.site.short}"
        return f"{self._call_of(a)} #{a.seq} (group {a.group}) at {a.site.short}"

    def _call_of(self, a: Activity) -> str:
        """The description of the collective ``a`` is in (``barrier(name='x')``)."""
        if a.call:
            return a.call
        group = self.groups.get(a.group)
        record = group.record_of(a.seq) if group is not None else None
        if record is None:
            return f"{a.op}()"
        return str(record.describe(site=False))

    def _departed_error(self, rank: int, where: str) -> PeerFailure:
        doing = self._doing() or "a call"
        hint = ("the ranks make different numbers of calls (uneven loop counts, or a "
                "collective on some ranks only?)")
        if self.activity.op == "barrier" and \
                self._call_of(self.activity).startswith("rank_zero_first"):
            hint = ("only some ranks entered rank_zero_first/main_process_first: every rank "
                    "of the group must enter it (do not call it from a rank-0-only branch)")
        exc = PeerFailure(f"rank {rank} finished and {where} while rank {self.rank} waits "
                          f"in {doing}: {hint}", rank=rank)
        exc.departed_where = where  # type: ignore[attr-defined]  # re-phrased in wait()
        return exc

    def _on_abort(self, src: int, payload: bytes) -> None:
        info = parse_abort(payload)
        report = info.get("report")
        if isinstance(report, dict):
            self.last_reports[src] = report
        self.router.fail_all(abort_error(AbortInfo(info, src, self.rank, self._doing())))

    # --- sending ----------------------------------------------------------------------------

    def send(self, dst: int, kind: int, payload: memoryview | bytes | None, deadline: float,
             *, group: int = 0, seq: int = 0, fp: Fingerprint | None = None,
             site: CallSite = UNKNOWN, step: int = 0, tag: int = 0) -> None:
        """Send one frame to global rank ``dst`` (site text first if new there)."""
        if site.id and site.id not in self._sites_sent[dst]:
            self._send_site(dst, site, deadline)
        n = 0 if payload is None else memoryview(payload).nbytes
        if fp is None:
            header = encode_header(kind, group=group, seq=seq, site=site.id, step=step,
                                   tag=tag, payload_len=n)
        else:
            header = encode_header(kind, group, seq, fp.op, fp.dtype, fp.reduce, 0, fp.root,
                                   fp.count, tag, site.id, step, n)
        self._send_raw(dst, header, payload, deadline)

    def send_frame(self, dst: int, header: bytes, payload: memoryview | None, deadline: float,
                   site: CallSite) -> None:
        """Send a frame whose header the caller packed (a collective's, see ``OpLink``)."""
        if site.id and site.id not in self._sites_sent[dst]:
            self._send_site(dst, site, deadline)
        self._send_raw(dst, header, payload, deadline)

    def _send_site(self, dst: int, site: CallSite, deadline: float) -> None:
        """Define ``site.id`` for ``dst`` (once per connection) before a frame names it."""
        self._sites_sent[dst].add(site.id)
        text = site.encode().encode()
        self._send_raw(dst, encode_header(Kind.SITE, site=site.id, payload_len=len(text)),
                       text, deadline)

    def _send_raw(self, dst: int, header: bytes, payload: memoryview | bytes | None,
                  deadline: float) -> None:
        try:
            self.transport.send(dst, header, payload, deadline)
        except DistNetworkError as exc:
            self.transport.drive_end()  # if this thread was the reader, let another read
            failure = self.router.wait_for_cause(dst, 1.0)
            if failure is not None:  # the cause explains it; the broken pipe adds nothing
                raise self._as_of_now(failure) from None
            raise PeerFailure(f"rank {self.rank} lost its connection to rank {dst} while "
                              f"sending: {exc}", rank=dst) from exc

    def wait(self, pending: Pending, deadline: float, what: Callable[[], str], *,
             patient: bool = False, quiet: bool = False) -> Frame:
        """Wait for ``pending`` in two phases: until the warning threshold, then (after
        logging a who-is-where table) until ``deadline``; a timeout carries the table.

        ``patient``: waiting on purpose (rank_zero_first's followers): no slow-wait
        warning, still bounded by ``deadline``.
        ``quiet``: no table, a bare ``DistTimeout`` (the caller reports by itself).
        """
        try:
            try:
                return self._block(pending, deadline, what, patient, quiet)
            finally:
                self._stop_driving_unless_done(pending)
        except DistTimeout:
            self.router.cancel(pending)
            if quiet:
                raise
            table = self._check_where(f"rank {self.rank} timed out in "
                                      f"{self._doing() or 'a wait'}")
            if self.dumper is not None:
                self.dumper.write(f"DistTimeout: {what()}")
            failure = self.router.failure
            if isinstance(failure, CollectiveMismatch):  # the table explained the hang
                raise failure from None
            raise DistTimeout(what() + self._held_note(), report=table) from None
        except PeerFailure as exc:
            now = self._as_of_now(exc)
            if now is exc:
                raise
            raise now from None
        except CollectiveMismatch:
            self.await_diagnosis()  # raise it with the divergence report in it
            raise

    def as_of_now(self, failure: BaseException) -> BaseException:
        """``failure`` worded for what this rank is doing now (see ``_as_of_now``)."""
        return self._as_of_now(failure)

    def _held_note(self) -> str:
        """Why a timeout may have happened on our side: peers we stopped reading because
        what they sent, nobody here received (see the parking caps in ``_router``)."""
        stats = self.router.parked()
        held = stats["held"]
        if not held:
            return ""
        per_peer = stats["per_peer"]
        assert isinstance(held, list) and isinstance(per_peer, dict)
        return (f"; rank {self.rank} stopped reading rank(s) {held}: messages from them that "
                f"no receive here asked for fill its room ({per_peer} bytes parked; caps "
                f"{stats['per_peer_cap']} per peer, {stats['total_cap']} in all: "
                "RANKWISE_PARKED_PER_PEER / RANKWISE_PARKED_TOTAL) — post the matching recv")

    def _as_of_now(self, failure: BaseException) -> BaseException:
        """A peer's goodbye, re-phrased to say what *this* rank is in now, not what it
        was doing when the goodbye came; other failures as they are."""
        where = getattr(failure, "departed_where", None)
        rank = getattr(failure, "rank", None)
        if where is None or rank is None:
            return failure
        return self._departed_error(rank, where)

    def _block(self, pending: Pending, deadline: float, what: Callable[[], str],
               patient: bool, quiet: bool) -> Frame:
        """The waiting itself, in the phases ``wait`` describes."""
        if pending.completed:
            return pending.wait(deadline, what)
        start = time.monotonic()
        if self.transport.driving():
            self._drive(pending, deadline if quiet else
                        min(deadline, start + min(self.warn_after, self.deadlock.after)))
            if pending.completed:
                return pending.wait(deadline, what)  # an error: ``wait`` stops driving
            self.transport.drive_end()  # past the first threshold: the I/O thread reads
        if quiet:
            return pending.wait(deadline, what)
        return self._watch(pending, start, deadline, what, patient)

    def _watch(self, pending: Pending, start: float, deadline: float,
               what: Callable[[], str], patient: bool) -> Frame:
        """A wait past the fast path: from ``deadlock.after`` s on, ask (backing off)
        whether every rank is blocked for good; at ``warn_after`` s log who is where
        (not when ``patient``); at ``deadline`` time out."""
        warn_at = math.inf if patient else start + self.warn_after
        probe_at = start + self.deadlock.after
        while True:
            until = min(warn_at, probe_at)
            if until >= deadline:
                return pending.wait(deadline, what)
            try:
                return pending.wait(until, what)
            except DistTimeout:
                pass
            now = time.monotonic()
            if now >= warn_at:
                warn_at = math.inf
                self._warn_slow(what)
            if now >= probe_at:
                probe_at = time.monotonic() + self.deadlock.probe(now - start)

    def _drive(self, pending: Pending, limit: float) -> None:
        """Read for ourselves until ``pending`` completes or ``limit`` (transport.drive_begin)."""
        progress = self.transport.progress
        while not pending.completed:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return
            progress(min(remaining, 0.25))

    def _stop_driving_unless_done(self, pending: Pending) -> None:
        """Anything but a clean completion hands reading back to the I/O thread before the
        caller goes on: warning tables, diagnosis and error reports wait for answers from
        the peers, and only a reader gets those to them."""
        if not pending.completed or pending.error is not None:
            self.transport.drive_end()

    def warn_slow(self, what: Callable[[], str]) -> None:
        """A wait passed ``warn_after``: log who is where (or fail every rank at once if
        the table shows a mismatch no message revealed)."""
        self._warn_slow(what)

    def _warn_slow(self, what: Callable[[], str]) -> None:
        try:
            table = self._check_where(f"rank {self.rank} has waited {self.warn_after:g}s "
                                      f"(RANKWISE_WARN_AFTER) in {self._doing() or 'a wait'}")
            if self.router.failure is not None:
                return  # the table explained the wait: the waiter raises, no warning
            log.warning("rankwise: slow wait on rank %d — %s\n%s", self.rank,
                        what().replace(" timed out after", " still waiting; timeout is"), table)
        except Exception as exc:  # noqa: BLE001 - diagnosis must never break the wait
            log.warning("rankwise: rank %d could not build a who-is-where report: %r",
                        self.rank, exc)

    def _check_where(self, headline: str) -> str:
        """Gather the table; if it shows ranks blocked in the same collective with
        different calls (a mismatch no frame revealed), fail every rank with it now."""
        reports = self.where_is_everyone(2.0)
        table = format_where(reports, headline)
        found = stalled_mismatch(reports)
        if found is None:
            return table
        group, seq, calls = found
        g = self.groups.get(group)
        gname = g.name if g is not None else f"group {group}"
        sides = [f"{_ranks(ranks)} called {call} at "
                 f"{reports[ranks[0]].get('site') or '<unknown>'}"
                 for call, ranks in sorted(calls.items(), key=lambda kv: kv[1][0])]
        first = sorted(calls.values(), key=lambda rs: rs[0])
        message = (
            f"collective mismatch in {gname}, collective #{seq}: " + ", but ".join(sides)
            + f". No message crossed between them (each waits to receive), so rank "
            f"{self.rank} found it by asking every rank where it is. Every rank of a group "
            "must make the same collective calls in the same order, with the same op, "
            "dtype, element count, root and reduce op.\n\n"
            + mismatch_report(reports, group, seq, first[0][0], first[1][0]))
        with self._diag_lock:
            if self.router.failure is not None:
                return table
            self._diagnosing = True
        self.broadcast_abort({"kind": "mismatch", "rank": self.rank, "message": message})
        self.router.fail_all(CollectiveMismatch(message))
        return table

    def where_table(self, headline: str, timeout: float = 2.0) -> str:
        """Ask every rank where it is and format one table (the slow path)."""
        return format_where(self.where_is_everyone(timeout), headline)

    # --- failures ---------------------------------------------------------------------------

    def _mismatch_message(self, frame: Frame, fp: Fingerprint | None, detail: str,
                          reports: dict[int, dict[str, Any]] | None = None) -> str:
        """Both calls, in the user's words. The peer's tensor shape is not in its frame
        (which carries element counts): it comes from its report, when there is one."""
        shape = (None if reports is None else
                 reported_shape(reports, frame.src, frame.group, frame.seq))
        theirs = describe_call(frame.op, frame.dtype, frame.count, frame.reduce, frame.root,
                               self.peer_sites[frame.src].get(frame.site), shape)
        group = self.groups.get(frame.group)
        record = group.record_of(frame.seq) if group is not None else None
        ours = (describe_call(fp.op, fp.dtype, fp.count, fp.reduce, fp.root,
                              self._site_of_seq(frame.group, frame.seq),
                              record.shape if record is not None else None)
                if fp is not None else "(a different call)")
        gname = f"group {frame.group}" if group is None else group.name
        return (
            f"collective mismatch in {gname}, collective #{frame.seq}: "
            f"rank {self.rank} called {ours}, but rank {frame.src} called {theirs}. "
            + (detail + ". " if detail else "")
            + mismatch_advice(frame.op, frame.root, fp.op if fp is not None else 0,
                              fp.root if fp is not None else 0)
        )

    def _on_mismatch(self, frame: Frame, fp: Fingerprint | None, detail: str) -> None:
        message = self._mismatch_message(frame, fp, detail)
        with self._diag_lock:
            if self._diagnosing or self.router.failure is not None:
                return
            self._diagnosing = True
            if enabled():
                self._diag_done = threading.Event()
        # Poison at once (no later frame may be used), but hold this rank's waiters in
        # ``wait`` until the report is in the exception: see ``await_diagnosis``.
        exc = CollectiveMismatch(message)
        self.router.fail_all(exc)
        if self._diag_done is None:
            self.broadcast_abort({"kind": "mismatch", "rank": self.rank, "message": message},
                                 background=True)
            return
        threading.Thread(target=self._diagnose_mismatch, args=(frame, fp, detail, exc),
                         name="rankwise-diagnose", daemon=True).start()

    def _diagnose_mismatch(self, frame: Frame, fp: Fingerprint | None, detail: str,
                           exc: CollectiveMismatch) -> None:
        """Off the I/O thread: gather every rank's history (bounded), complete the
        exception's message, tell the peers, then release this rank's waiters."""
        assert self._diag_done is not None
        report = ""
        message = str(exc)
        try:
            reports = self.where_is_everyone(2.0)
            message = self._mismatch_message(frame, fp, detail, reports)
            report = mismatch_report(reports, frame.group, frame.seq, self.rank, frame.src)
        except Exception as err:  # noqa: BLE001 - a report must never hide the mismatch
            report = f"(the divergence report failed: {err!r})"
        full = message + ("\n\n" + report if report else "")
        exc.args = (full,)
        try:
            self.tell_mismatch(full)
        finally:
            self._diag_done.set()

    def tell_mismatch(self, message: str) -> None:
        """Tell the peers about a mismatch this rank found, with this rank's report.
        Peers before our own raise: this rank may exit right after, and the abort must
        reach them before its closed connection does; a peer still gathering reports for
        its own message then has our history even if its question comes after we left."""
        self.broadcast_abort({"kind": "mismatch", "rank": self.rank, "message": message,
                              "report": self.where.mine()})

    def await_diagnosis(self, timeout: float = 5.0) -> None:
        """Block (bounded) until a mismatch report being built is in its exception."""
        done = self._diag_done
        if done is not None:
            done.wait(timeout)

    def _site_of_seq(self, group: int, seq: int) -> CallSite | None:
        if self.site_lookup is not None:
            return self.site_lookup(group, seq)
        g = self.groups.get(group)
        return g.site_of(seq) if g is not None else None

    def broadcast_abort(self, info: dict[str, Any], background: bool = False,
                        timeout: float = 2.0) -> None:
        """Tell every peer that this rank failed. In the background when called from the
        I/O thread (which must keep draining so peers' sends cannot block it)."""
        payload = json.dumps(info).encode()[: (8 << 20)]

        def run() -> None:
            self._tell_everyone(Kind.ABORT, payload, time.monotonic() + timeout)

        if background:
            threading.Thread(target=run, name="rankwise-abort", daemon=True).start()
        else:
            run()

    def relay_of(self, failure: BaseException) -> dict[str, Any]:
        """The ABORT that passes on a failure this rank only suffered (a dead or failed
        peer, a mismatch): it names the rank where it started, so peers that hear from us
        first blame the right rank, not us."""
        origin = getattr(failure, "rank", None)
        return {"kind": kind_of(failure),
                "rank": self.rank if origin is None else origin, "relayed_by": self.rank,
                "message": str(failure)[:20000],
                "traceback": str(getattr(failure, "remote_traceback", ""))[:40000],
                "last": str(getattr(failure, "last_collective", ""))}

    def _tell_everyone(self, kind: Kind, payload: bytes, deadline: float) -> None:
        """One control frame to every live peer; a peer we cannot reach is skipped (this
        runs while failing or leaving, when nothing better can be done about it)."""
        header = encode_header(kind, payload_len=len(payload))
        for peer in range(self.world_size):
            if peer != self.rank and not self.router.peer_gone(peer):
                try:
                    self.transport.send(peer, header, payload, deadline)
                except DistError:
                    pass

    def goodbye(self, where: str, timeout: float = 2.0) -> None:
        """Tell peers we leave cleanly, then close the connections."""
        if self.closed:
            return
        if self.tracer is not None:
            try:
                self.tracer.write()
            except OSError as exc:
                log.warning("rankwise: could not write the trace of rank %d: %s", self.rank, exc)
        failure = self.router.failure
        if failure is None:
            # answers to "where are you?" first: a peer stops waiting for ours once it has
            # our goodbye, so an answer sent after it would be lost ("exited" in its report)
            self.where.settle(min(timeout, 1.0))
            self._tell_everyone(Kind.BYE, where.encode()[:2000], time.monotonic() + timeout)
        else:
            # Leaving after a failure: pass the root cause on. Without this, a peer that
            # notices our closed connection before the original one blames us.
            self.broadcast_abort(self.relay_of(failure), timeout=timeout)
            if self.dumper is not None:
                self.dumper.write(f"left after {type(failure).__name__}: {failure}")
        self.where.settle(min(timeout, 1.0))
        self.closed = True
        self.transport.close()

    def _last_from(self, rank: int) -> str:
        frame = self._last_seen.get(rank)
        if frame is None:
            return next((text for source in self.peer_call_sources
                         if (text := source(rank))), "")
        site = self.peer_sites.get(rank, {}).get(frame.site)
        call = describe_call(frame.op, frame.dtype, frame.count, frame.reduce, frame.root, site)
        return f"{call} (#{frame.seq} of group {frame.group})"

    # --- who is where -----------------------------------------------------------------------

    def _report(self) -> dict[str, Any]:
        report = build_report(self)
        report["blocked"] = blocked_state(self)  # what the deadlock detector compares
        return report

    @property
    def departures(self) -> dict[int, str]:
        """Peers that said goodbye, with where they left ("called destroy_process_group at
        train.py:99")."""
        return self._bye

    def where_is_everyone(self, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
        """Every rank's state report (see ``checks.where``)."""
        return self.where.ask_everyone(timeout)


def _ranks(ranks: list[int]) -> str:
    return rank_list(ranks)


class _Text:
    """A ``last_call`` given as text (legacy setter) quacking like a CallRecord."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.seq = 0

    def describe(self) -> str:
        return self.text
