"""Asking every rank "where are you?" and answering it, over the job's own connections.

Why here and not in the communicator: this is the slow path of diagnosis, used only when
something is already wrong (a slow wait, a timeout, a mismatch). It rides on two control
frames (``Kind.WHERE`` / ``Kind.HERE``) that the I/O thread hands over, so a rank that
is busy computing still answers. Answers are sent by one long-lived thread per rank:
the I/O thread must never block on a send, and a thread per answer cost a thread start
per rank and probe.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import DistError
from ..wire.frames import Frame, Kind, encode_header

if TYPE_CHECKING:
    from ..core.communicator import Communicator

__all__ = ["WhereService"]

Report = dict[str, Any]


class WhereService:
    """One per communicator: answers peers' WHERE requests and gathers everyone's state."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._lock = threading.Lock()
        self._next_id = 0
        self._waiting: dict[int, tuple[threading.Event, dict[int, Report], int]] = {}
        self._ready = threading.Condition(self._lock)  #: an answer queued, or one sent
        self._queue: deque[tuple[int, bytes, bytes]] = deque()  #: answers not yet sent
        self._unsent = 0  #: queued or being sent
        self._sender: threading.Thread | None = None

    def mine(self) -> Report:
        """This rank's report, as it answers WHERE."""
        try:
            return self._comm.report_provider()
        except Exception as exc:  # noqa: BLE001 - a report must never kill the I/O thread
            return {"rank": self._comm.rank, "state": f"(report failed: {exc!r})"}

    def answer(self, frame: Frame) -> None:
        """A peer asked (I/O thread): queue this rank's report for the answering thread.

        One long-lived thread sends every answer (the I/O thread must never block on a
        send): a probe wave costs no thread start per answer."""
        payload = json.dumps(self.mine()).encode()[: (4 << 20)]
        header = encode_header(Kind.HERE, tag=frame.tag, payload_len=len(payload))
        with self._lock:
            self._queue.append((frame.src, header, payload))
            self._unsent += 1
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_answers, name="rankwise-here",
                                                daemon=True)
                self._sender.start()
            self._ready.notify()

    def _send_answers(self) -> None:
        transport = self._comm.transport
        while True:
            with self._lock:
                while not self._queue:
                    self._ready.wait()
                dst, header, payload = self._queue.popleft()
            try:
                transport.send(dst, header, payload, time.monotonic() + 2.0)
            except DistError:
                pass
            finally:
                with self._lock:
                    self._unsent -= 1
                    self._ready.notify_all()

    def settle(self, timeout: float) -> None:
        """Let answers still being sent go out (bounded) before this rank leaves: a peer
        building a mismatch report waits for ours, and a daemon thread dies at exit."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._unsent:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._ready.wait(left)

    def on_here(self, frame: Frame, payload: bytes) -> None:
        """A peer answered (I/O thread)."""
        with self._lock:
            entry = self._waiting.get(frame.tag)
        if entry is None:
            return  # an answer that came after we stopped waiting
        try:
            report = json.loads(payload.decode("utf-8", "replace"))
        except ValueError:
            report = {"state": "(unreadable report)"}
        event, answers, expected = entry
        answers[frame.src] = report if isinstance(report, dict) else {"state": str(report)}
        if len(answers) >= expected:
            event.set()

    def ask_everyone(self, timeout: float = 2.0) -> dict[int, Report]:
        """Every rank's report; ranks that left, died or did not answer are marked so."""
        comm, router = self._comm, self._comm.router
        peers = [p for p in range(comm.world_size) if p != comm.rank]
        live = [p for p in peers if not router.peer_gone(p)]
        event = threading.Event()
        answers: dict[int, Report] = {}
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._waiting[rid] = (event, answers, len(live))
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                comm.transport.send(p, encode_header(Kind.WHERE, tag=rid), None, deadline)
            except DistError:
                pass
        while live and not event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            event.wait(min(left, 0.05))
            # a peer that leaves or dies meanwhile will never answer: stop waiting for it
            if all(p in answers or p in comm.last_reports or router.peer_gone(p) is not None
                   for p in live):
                break
        with self._lock:
            self._waiting.pop(rid, None)
        result: dict[int, Report] = {comm.rank: self.mine()}
        for p in peers:
            gone = router.peer_gone(p)
            if p in answers:
                result[p] = answers[p]
            elif p in comm.last_reports:  # it failed, and sent its report with the abort
                result[p] = comm.last_reports[p]
            elif p in comm.departures.bye:
                result[p] = {"rank": p, "state": f"exited: {comm.departures.bye[p]}",
                             "gone": True}
            elif gone is not None:
                result[p] = {"rank": p, "state": f"gone: {gone}", "gone": True}
            else:
                result[p] = {"rank": p, "no_answer": True, "state": "did not answer within "
                             f"{timeout:g}s (hung, stopped, or busy without releasing the GIL)"}
        return result
