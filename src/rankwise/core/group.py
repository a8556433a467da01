"""Process groups: members, sequence numbers, call history, and the engine.

A group is an ordered list of global ranks sharing the job's one mesh of connections;
its id travels in every frame header, and each group numbers its collectives
(``seq``) so frames of different calls never mix, even when several are in flight.
Every call is recorded in a small per-group history (op, seq, call site, time): the
raw material of mismatch and hang reports.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Any

from ..engines.base import Call, Engine, new_call
from ..errors import InvalidArgument
from ..identity.calls import COMM_LABEL, Fingerprint
from ..identity.callsite import CallSite
from ..wire.buffers import DType, ReduceOp
from .communicator import Communicator
from .messages import MessageEngine
from .work import Work

__all__ = ["CallRecord", "ProcessGroup", "seconds"]

HISTORY = 64


#: a call's history entry is the call itself (see ``engines.base.Call``)
CallRecord = Call


class ProcessGroup:
    """A set of ranks that make collective calls together (torch's ``ProcessGroup``)."""

    #: why the group may no longer be used: its world was replaced (``api.recovery``)
    retired: str | None = None
    #: (``engine`` when made, the engine for tensors that stay tensors, its call flags):
    #: ``engines.device.device_engine`` kept by the API while ``engine`` is the same
    device_route: tuple[Engine, Engine, int] | None = None

    def __init__(self, comm: Communicator, group_id: int, ranks: list[int], timeout: float,
                 backend: str, name: str, register: bool = True) -> None:
        self.comm = comm
        #: all an engine may reach of the rest of the job (``core.port``)
        self.port = comm.port
        self.id = group_id
        self.ranks = ranks
        self._index = {g: i for i, g in enumerate(ranks)}
        self.timeout = timeout
        self.backend = backend
        self.name = name
        self.seq = 0
        #: the observers of this group's calls, by engine, and what they keep
        #: (``api.observers.observed``)
        self.observers: dict[Any, Any] = {}
        #: the last calls, oldest first (looked up by seq on the slow path only: a dict
        #: beside it cost two updates per call)
        self.history: deque[CallRecord] = deque(maxlen=HISTORY)
        #: per-peer messages: always there (control plane, monitored_barrier, p2p)
        self.messages = MessageEngine(comm)
        #: what moves this group's collective data (``engines.select`` may replace it)
        self.engine: Engine = self.messages
        #: the last async call queued on a serial engine (see ``Engine.serial``)
        self.queued: Work | None = None
        if register:  # who-is-where reports read every group's history
            comm.groups[group_id] = self

    def part(self, ranks: list[int], name: str) -> ProcessGroup:
        """Some of this group's members (global ``ranks``) as a group of their own, for an
        engine built of smaller ones (``engines.tiers``): same id, connections and
        timeout, but unregistered, so no frame, report or user call ever reaches it."""
        return ProcessGroup(self.comm, self.id, ranks, self.timeout, self.backend, name,
                            register=False)

    def engine_name(self) -> str:
        """The engine that moves this group's collective data (``"shm"``, ``"tcp"``,
        ``"tiers"``, ...); ``get_backend`` reports the backend name the user asked for
        instead, as torch."""
        return self.engine.name

    # torch-compatible accessors
    def rank(self) -> int:
        return self._index[self.comm.rank]

    def size(self) -> int:
        return len(self.ranks)

    @property
    def group_rank(self) -> int:
        return self._index[self.comm.rank]

    def index_of(self, global_rank: int) -> int | None:
        """The group rank of ``global_rank``, None when it is not a member."""
        return self._index.get(global_rank)

    def group_rank_of(self, global_rank: int, what: str) -> int:
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise InvalidArgument(f"{what} must be an int rank, got {global_rank!r}")
        idx = self._index.get(global_rank)
        if idx is None:
            raise InvalidArgument(
                f"{what}={global_rank} is not a member of {self.name} (global ranks "
                f"{self.ranks}); {what} is a global rank, as in torch.distributed"
            )
        return idx

    def begin(self, fp: Fingerprint, site: CallSite, dtype: DType | None,
              op: ReduceOp | None, frames: bool = True,
              shape: tuple[int, ...] | None = None) -> Call:
        """Take the next sequence number and register the call (before any I/O); the
        call, already in the group's history.

        ``frames``: the call's data moves in frames (message engine), so the router must
        know the call to check frames that arrive before or for it; calls on another
        engine skip that bookkeeping."""
        router = self.comm.router
        if router.failure is not None:
            self.comm.await_diagnosis()
            router.check_alive()
        self.seq = seq = self.seq + 1
        now = time.time()
        call = new_call(self, seq, fp, site, dtype, op, time.monotonic() + self.timeout, now,
                        shape)
        label = COMM_LABEL.get()
        if label is not None:
            call.label = label
        self.history.append(call)
        if frames:
            router.register_call(self.id, seq, fp)
        return call

    def site_of(self, seq: int) -> CallSite | None:
        rec = self.record_of(seq)
        return rec.site if rec is not None else None

    def record_of(self, seq: int) -> CallRecord | None:
        """Call #seq, if it is among the last ``HISTORY`` (any thread: a copy is read)."""
        for rec in reversed(self.recent(HISTORY)):
            if rec.seq == seq:
                return rec
        return None

    def recent(self, n: int) -> list[CallRecord]:
        """The last ``n`` calls, safe to call from the I/O thread while calls are made."""
        for _ in range(5):
            try:
                return list(self.history)[-n:]
            except RuntimeError:  # deque mutated during the copy: try again
                continue
        return []

    def __repr__(self) -> str:
        return f"<rankwise.ProcessGroup {self.name} ranks={self.ranks}>"


def seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)
