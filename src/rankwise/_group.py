"""Process groups and the per-call ``Link`` that algorithms run over.

A group is an ordered list of global ranks sharing the job's one mesh of connections;
its id travels in every frame header, and each group numbers its collectives
(``seq``) so frames of different calls never mix, even when several are in flight.
Every call is recorded in a small per-group history (op, seq, call site, time): the
raw material of mismatch and hang reports.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from ._buffers import DType, ReduceOp, divide_in_place, reduce_into
from ._callsite import CallSite
from ._comm import Communicator, describe_call
from ._router import Fingerprint, Pending
from ._wire import HEADER, MAGIC, VERSION, Kind
from .errors import InvalidArgument

__all__ = ["CallRecord", "OpLink", "ProcessGroup"]

HISTORY = 64
_pack = HEADER.pack


@dataclass(slots=True)
class CallRecord:
    seq: int
    fp: Fingerprint
    site: CallSite
    started: float
    finished: float = 0.0

    def describe(self) -> str:
        fp = self.fp
        return describe_call(fp.op, fp.dtype, fp.count, fp.reduce, fp.root, self.site)


class ProcessGroup:
    """A set of ranks that make collective calls together (torch's ``ProcessGroup``)."""

    def __init__(self, comm: Communicator, group_id: int, ranks: list[int], timeout: float,
                 backend: str, name: str) -> None:
        self.comm = comm
        self.id = group_id
        self.ranks = ranks
        self._index = {g: i for i, g in enumerate(ranks)}
        self.timeout = timeout
        self.backend = backend
        self.name = name
        self.seq = 0
        self.history: deque[CallRecord] = deque(maxlen=HISTORY)
        self._records: dict[int, CallRecord] = {}
        comm.groups[group_id] = self  # who-is-where reports read every group's history

    # torch-compatible accessors
    def rank(self) -> int:
        return self._index[self.comm.rank]

    def size(self) -> int:
        return len(self.ranks)

    @property
    def group_rank(self) -> int:
        return self._index[self.comm.rank]

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

    def begin(self, fp: Fingerprint, site: CallSite) -> tuple[int, CallRecord]:
        """Take the next sequence number and register the call (before any I/O)."""
        if self.comm.router.failure is not None:
            self.comm.await_diagnosis()
        self.comm.router.check_alive()
        self.seq += 1
        seq = self.seq
        record = CallRecord(seq, fp, site, time.time())
        self.history.append(record)
        self._records[seq] = record
        self._records.pop(seq - HISTORY, None)
        self.comm.router.register_call(self.id, seq, fp)
        return seq, record

    def site_of(self, seq: int) -> CallSite | None:
        rec = self._records.get(seq)
        return rec.site if rec is not None else None

    def record_of(self, seq: int) -> CallRecord | None:
        return self._records.get(seq)

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


class OpLink:
    """One collective call's view of its group: the ``Link`` the algorithms use."""

    __slots__ = (
        "comm",
        "deadline",
        "dtype",
        "fp",
        "group",
        "head",
        "op",
        "patient",
        "quiet",
        "rank",
        "record",
        "seq",
        "site",
        "size",
    )

    def __init__(self, group: ProcessGroup, seq: int, record: CallRecord, dtype: DType | None,
                 op: ReduceOp | None) -> None:
        self.group = group
        self.comm = group.comm
        self.seq = seq
        self.record = record
        self.fp = record.fp
        self.site = record.site
        self.deadline = time.monotonic() + group.timeout
        self.dtype = dtype
        self.op = op
        self.rank = group.group_rank
        self.size = len(group.ranks)
        #: wait without deadline (rank_zero_first's followers wait while rank 0 works)
        self.patient = False
        #: on timeout raise a bare DistTimeout (the caller builds its own report)
        self.quiet = False
        fp = self.fp
        #: every header field of this call's frames but the step and the payload length
        self.head = (MAGIC, VERSION, Kind.COLL, group.id, seq, fp.op, fp.dtype, fp.reduce, 0,
                     fp.root, fp.count, 0, self.site.id)

    def send(self, peer: int, data: np.ndarray[Any, Any], step: int) -> None:
        # the header is packed here rather than in Communicator.send: this runs for every
        # frame of every collective, and one pack of prepared fields is the cheapest way
        n = data.nbytes
        self.comm.send_frame(self.group.ranks[peer], _pack(*self.head, step, n),
                             data.view(np.uint8).data if n else None, self.deadline, self.site)

    def post(self, peer: int, out: np.ndarray[Any, Any], step: int) -> Pending:
        key = (self.group.id, self.seq, self.group.ranks[peer], step)
        return self.comm.router.post_coll(key, out.view(np.uint8).data)

    def wait(self, handle: Any) -> None:
        assert isinstance(handle, Pending)
        activity = self.comm.activity
        activity.waiting_for = handle.src
        activity.patient = self.patient
        if handle.completed and handle.error is None:
            return  # it has landed: nothing to wait for (the common case in a pipeline)
        self.comm.wait(handle, self.deadline, self._timeout_message(handle.src),
                       patient=self.patient, quiet=self.quiet)

    def _timeout_message(self, src: int) -> Callable[[], str]:
        def describe() -> str:
            return (
                f"rank {self.comm.rank} timed out after {self.group.timeout:.0f}s in "
                f"{self.record.describe()} (collective #{self.seq} of {self.group.name}) "
                f"waiting for rank {src}"
            )
        return describe

    def reduce(self, acc: np.ndarray[Any, Any], incoming: np.ndarray[Any, Any]) -> None:
        assert self.dtype is not None and self.op is not None
        reduce_into(acc, incoming, self.dtype, self.op)

    def finish_avg(self, acc: np.ndarray[Any, Any]) -> None:
        if self.op is not None and self.op.name == "AVG":
            assert self.dtype is not None
            divide_in_place(acc, self.dtype, self.size)


def seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)
