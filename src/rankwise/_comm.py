"""One process's connection to the rest of the job: sending, receiving, and failing loudly.

The communicator sits between the API and the transport. It fills frame headers with
the call's fingerprint, sends each call site's text once per connection, turns arriving
control frames into state (a peer's abort, a clean goodbye, a "where are you?"), and
makes sure that any failure anywhere becomes an exception in every waiting thread of
every rank at once — never a silent wait until the timeout.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ._buffers import dtype_name, reduce_op_by_code
from ._callsite import UNKNOWN, CallSite, site_text
from ._router import Fingerprint, Pending, Router
from ._wire import Frame, Kind, Op, encode_header
from .errors import CollectiveMismatch, DistError, DistNetworkError, DistTimeout, PeerFailure
from .transport.base import Transport

__all__ = ["Communicator", "Activity", "describe_call"]


def describe_call(op: int, dtype: int, count: int, reduce: int, root: int,
                  site: CallSite | None) -> str:
    """``all_reduce(float32 x 1024, op=SUM) at train.py:42 in step``."""
    name = Op(op).name if op in Op._value2member_map_ else f"op#{op}"
    args = []
    if dtype:
        args.append(f"{dtype_name(dtype)} x {count}" if count >= 0 else dtype_name(dtype))
    rop = reduce_op_by_code(reduce)
    if rop is not None:
        args.append(f"op={rop.name}")
    if op in (Op.broadcast, Op.scatter, Op.reduce, Op.gather, Op.broadcast_object_list,
              Op.gather_object, Op.scatter_object_list):
        args.append(f"root={root}")
    where = f" at {site.short}" if site is not None and site.frames else ""
    return f"{name}({', '.join(args)}){where}"


@dataclass(slots=True)
class Activity:
    """What this rank is doing now, for who-is-where reports."""

    op: str = ""
    group: int = 0
    seq: int = 0
    site: CallSite = UNKNOWN
    since: float = field(default_factory=time.time)
    waiting_for: int = -1


class Communicator:
    """Owns the transport and router of this process for the lifetime of the job."""

    def __init__(self, rank: int, world_size: int, transport: Transport) -> None:
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.router = Router(self._on_mismatch)
        self._sites_sent: dict[int, set[int]] = {r: set() for r in range(world_size)}
        self.peer_sites: dict[int, dict[int, CallSite]] = {r: {} for r in range(world_size)}
        self._bye: dict[int, str] = {}
        self.activity = Activity()
        self.last_call = ""
        self.report_provider: Callable[[], dict[str, Any]] = self._basic_report
        self._where_waiters: dict[int, tuple[threading.Event, dict[int, dict[str, Any]]]] = {}
        self._where_lock = threading.Lock()
        self._where_id = 0
        self._where_expected: dict[int, int] = {}
        self.site_lookup: Callable[[int, int], CallSite | None] | None = None
        self.closed = False
        transport.start(self)

    # --- FrameHandler ----------------------------------------------------------------------

    def on_header(self, frame: Frame) -> tuple[memoryview | bytearray, object]:
        if frame.kind in (Kind.COLL, Kind.P2P, Kind.OBJ):
            return self.router.on_header(frame)
        buf = bytearray(frame.payload_len)
        return buf, buf

    def on_payload(self, frame: Frame, token: object) -> None:
        if frame.kind in (Kind.COLL, Kind.P2P, Kind.OBJ):
            self.router.on_payload(frame, token)  # type: ignore[arg-type]
        else:  # control frames: the token is the bytearray we returned in on_header
            assert isinstance(token, bytearray)
            self.on_control(frame, bytes(token))

    def on_peer_lost(self, rank: int, reason: BaseException | None) -> None:
        if self.closed:
            return
        bye = self._bye.get(rank)
        if bye is not None:
            self.router.fail_peer(rank, self._departed_error(rank, bye))
            return
        exc = PeerFailure(
            f"rank {rank} died: its connection to rank {self.rank} was lost "
            f"({reason or 'closed'}) without a goodbye — the process crashed, was killed, "
            f"or its machine went away. Last collective seen from it: "
            f"{self._last_from(rank) or 'none'}",
            rank=rank,
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
            self._answer_where(frame)
        elif frame.kind == Kind.HERE:
            self._on_here(frame, payload)

    def _departed_error(self, rank: int, where: str) -> PeerFailure:
        mine = self.activity
        doing = f"{mine.op} #{mine.seq} at {mine.site.short}" if mine.op else "a call"
        return PeerFailure(
            f"rank {rank} finished and left the job ({where}) while rank {self.rank} still "
            f"needs it in {doing}: the ranks make different numbers of calls "
            f"(uneven loop counts, or a collective on some ranks only?)",
            rank=rank,
        )

    def _on_abort(self, src: int, payload: bytes) -> None:
        try:
            info = json.loads(payload.decode("utf-8", "replace"))
            if not isinstance(info, dict):
                raise ValueError
        except ValueError:
            info = {"kind": "exception", "message": "(unreadable abort message)"}
        kind = str(info.get("kind", "exception"))
        message = str(info.get("message", ""))[:20000]
        origin = int(info.get("rank", src)) if str(info.get("rank", src)).isdigit() else src
        exc: DistError
        if kind == "mismatch":
            exc = CollectiveMismatch(message + f"\n(detected by rank {origin}; reported to "
                                     f"rank {self.rank})")
        else:
            tb = str(info.get("traceback", ""))[:50000]
            last = str(info.get("last", ""))
            exc = PeerFailure(
                f"rank {origin} failed: {message}\n"
                f"its last collective: {last or 'none'}\n"
                + (f"its traceback:\n{tb}" if tb else ""),
                rank=origin, remote_traceback=tb, last_collective=last,
            )
        self.router.fail_all(exc)

    # --- sending ----------------------------------------------------------------------------

    def send(self, dst: int, kind: int, payload: memoryview | bytes | None, deadline: float,
             *, group: int = 0, seq: int = 0, fp: Fingerprint | None = None,
             site: CallSite = UNKNOWN, step: int = 0, tag: int = 0) -> None:
        """Send one frame to global rank ``dst`` (site text first if new there)."""
        if site.id and site.id not in self._sites_sent[dst]:
            self._sites_sent[dst].add(site.id)
            text = site.encode().encode()
            self._send_raw(dst, encode_header(Kind.SITE, site=site.id, payload_len=len(text)),
                           text, deadline)
        n = 0 if payload is None else memoryview(payload).nbytes
        if fp is None:
            header = encode_header(kind, group=group, seq=seq, site=site.id, step=step,
                                   tag=tag, payload_len=n)
        else:
            header = encode_header(kind, group, seq, fp.op, fp.dtype, fp.reduce, 0, fp.root,
                                   fp.count, tag, site.id, step, n)
        self._send_raw(dst, header, payload, deadline)

    def _send_raw(self, dst: int, header: bytes, payload: memoryview | bytes | None,
                  deadline: float) -> None:
        try:
            self.transport.send(dst, header, payload, deadline)
        except DistNetworkError as exc:
            failure = self.router.failure or self.router.peer_gone(dst)
            if failure is not None:
                raise failure from exc
            raise PeerFailure(f"rank {self.rank} lost its connection to rank {dst} while "
                              f"sending: {exc}", rank=dst) from exc

    def wait(self, pending: Pending, deadline: float, what: Callable[[], str]) -> Frame:
        try:
            return pending.wait(deadline, what)
        except DistTimeout:
            self.router.cancel(pending)
            raise

    # --- failures ---------------------------------------------------------------------------

    def _on_mismatch(self, frame: Frame, fp: Fingerprint | None, detail: str) -> None:
        theirs = describe_call(frame.op, frame.dtype, frame.count, frame.reduce, frame.root,
                               self.peer_sites[frame.src].get(frame.site))
        ours = (describe_call(fp.op, fp.dtype, fp.count, fp.reduce, fp.root,
                              self._site_of_seq(frame.group, frame.seq))
                if fp is not None else "(a different call)")
        message = (
            f"collective mismatch in group {frame.group}, collective #{frame.seq}: "
            f"rank {self.rank} called {ours}, but rank {frame.src} called {theirs}. "
            + (detail + ". " if detail else "")
            + "Every rank of a group must make the same collective calls in the same order, "
            "with the same op, dtype, element count, root and reduce op."
        )
        exc = CollectiveMismatch(message)
        if self.router.failure is None:
            self.router.fail_all(exc)
            self.broadcast_abort({"kind": "mismatch", "rank": self.rank, "message": message},
                                 background=True)

    def _site_of_seq(self, group: int, seq: int) -> CallSite | None:
        return self.site_lookup(group, seq) if self.site_lookup is not None else None

    def broadcast_abort(self, info: dict[str, Any], background: bool = False,
                        timeout: float = 2.0) -> None:
        """Tell every peer that this rank failed. In the background when called from the
        I/O thread (which must keep draining so peers' sends cannot block it)."""
        payload = json.dumps(info).encode()[: (8 << 20)]

        def run() -> None:
            deadline = time.monotonic() + timeout
            for peer in range(self.world_size):
                if peer == self.rank or self.router.peer_gone(peer):
                    continue
                try:
                    self.transport.send(peer, encode_header(Kind.ABORT,
                                                            payload_len=len(payload)),
                                        payload, deadline)
                except DistError:
                    pass

        if background:
            threading.Thread(target=run, name="rankwise-abort", daemon=True).start()
        else:
            run()

    def goodbye(self, where: str, timeout: float = 2.0) -> None:
        """Tell peers we leave cleanly, then close the connections."""
        if self.closed:
            return
        payload = where.encode()[:2000]
        deadline = time.monotonic() + timeout
        if self.router.failure is None:
            for peer in range(self.world_size):
                if peer != self.rank and not self.router.peer_gone(peer):
                    try:
                        self.transport.send(peer, encode_header(Kind.BYE,
                                                                payload_len=len(payload)),
                                            payload, deadline)
                    except DistError:
                        pass
        self.closed = True
        self.transport.close()

    def _last_from(self, rank: int) -> str:
        sites = self.peer_sites.get(rank) or {}
        if not sites:
            return ""
        last = list(sites.values())[-1]
        return f"a call at {last.short}"

    # --- who is where -----------------------------------------------------------------------

    def _basic_report(self) -> dict[str, Any]:
        a = self.activity
        if a.op:
            state = f"in {a.op} #{a.seq} (group {a.group}) at {a.site.chain} since " \
                    f"{time.time() - a.since:.1f}s" + (
                        f", waiting for rank {a.waiting_for}" if a.waiting_for >= 0 else "")
        else:
            state = f"running user code since {time.time() - a.since:.1f}s" + (
                f" (last call: {self.last_call})" if self.last_call else "")
        return {"rank": self.rank, "state": state}

    def _answer_where(self, frame: Frame) -> None:
        try:
            report = self.report_provider()
        except Exception as exc:  # a report must never kill the I/O thread
            report = {"rank": self.rank, "state": f"(report failed: {exc!r})"}
        payload = json.dumps(report).encode()[: (4 << 20)]
        header = encode_header(Kind.HERE, tag=frame.tag, payload_len=len(payload))

        def run() -> None:
            try:
                self.transport.send(frame.src, header, payload, time.monotonic() + 2.0)
            except DistError:
                pass

        threading.Thread(target=run, name="rankwise-here", daemon=True).start()

    def _on_here(self, frame: Frame, payload: bytes) -> None:
        with self._where_lock:
            entry = self._where_waiters.get(frame.tag)
        if entry is None:
            return
        try:
            report = json.loads(payload.decode("utf-8", "replace"))
        except ValueError:
            report = {"state": "(unreadable report)"}
        event, answers = entry
        answers[frame.src] = report if isinstance(report, dict) else {"state": str(report)}
        if len(answers) >= self._where_expected.get(frame.tag, 0):
            event.set()

    def where_is_everyone(self, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
        """Ask every live peer for its state; ranks that do not answer are marked so."""
        with self._where_lock:
            self._where_id += 1
            rid = self._where_id
            event = threading.Event()
            answers: dict[int, dict[str, Any]] = {}
            self._where_waiters[rid] = (event, answers)
        peers = [p for p in range(self.world_size) if p != self.rank]
        live = [p for p in peers if not self.router.peer_gone(p)]
        self._where_expected[rid] = len(live)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                self.transport.send(p, encode_header(Kind.WHERE, tag=rid), None, deadline)
            except DistError:
                pass
        if live:
            event.wait(timeout)
        with self._where_lock:
            self._where_waiters.pop(rid, None)
        self._where_expected.pop(rid, None)
        result: dict[int, dict[str, Any]] = {self.rank: self.report_provider()}
        for p in peers:
            if p in answers:
                result[p] = answers[p]
            elif self.router.peer_gone(p) is not None:
                result[p] = {"rank": p, "state": f"gone: {self.router.peer_gone(p)}"}
            else:
                result[p] = {"rank": p, "state": "did not answer within "
                             f"{timeout:.0f}s (hung, stopped, or busy without releasing the GIL)"}
        return result
