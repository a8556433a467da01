"""The message engine: the pure algorithms over per-peer framed transports.

Why it exists as an engine: it works between any two ranks (TCP across hosts, or any
transport the mesh provides), and every group keeps one even when another engine moves
its data, for the calls that need per-peer messages (``monitored_barrier``) and as the
control plane. Algorithm choice by size lives here, not in the API.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import algorithms as alg
from .. import settings
from ..algorithms.link import Lane, Link
from ..engines.base import HOST_CAPS, Array, Call
from ..wire.buffers import DType, ReduceOp, divide_in_place, reduce_into
from ..wire.frames import HEADER, MAGIC, VERSION, Flag, Kind
from .communicator import Communicator
from .failures import call_timeout
from .router import Pending

if TYPE_CHECKING:
    from .group import CallRecord, ProcessGroup

__all__ = ["MessageEngine", "OpLink"]

_pack = HEADER.pack

#: the header flag of each lane an algorithm may send on (``Lane`` stays free of wire bits)
_LANE_FLAGS = {Lane.DATA: 0, Lane.CTS: int(Flag.CTS), Lane.GATHER: int(Flag.GATHER)}

#: below this many bytes all_reduce uses recursive doubling (latency), above it the ring
RING_THRESHOLD = settings.integer("RANKWISE_RING_THRESHOLD")
ALLREDUCE_ALGORITHM = settings.choice("RANKWISE_ALLREDUCE")
#: from this size a blocking collective reads its own frames (transport.drive_begin):
#: the hand-over costs a few wake-ups, each saved frame hand-off one or two
DRIVE_BYTES = settings.integer("RANKWISE_DRIVE_BYTES")


#: from this group size a crowded job (``transport.crowding``) reduces small messages up a
#: tree and broadcasts them back down, instead of recursive doubling
CROWDED_TREE_FROM = 8


def all_reduce_algorithm(nbytes: int, numel: int, n: int,
                         crowded: bool = False) -> Callable[[Link, Array], None]:
    """Latency-bound sizes: recursive doubling (log2 n rounds), or the tree when ranks
    outnumber CPUs (fewer wake-ups per rank). Bandwidth-bound sizes: Rabenseifner on
    powers of two (2 log2 n hops), else the pipelined ring. ``RANKWISE_ALLREDUCE`` =
    doubling | tree | ring | halving forces one (benchmarking)."""
    forced = ALLREDUCE_ALGORITHM
    if nbytes < RING_THRESHOLD and (
            forced == "tree" or (forced == "auto" and crowded and n >= CROWDED_TREE_FROM)):
        return alg.tree.all_reduce
    if forced == "doubling" or numel < n or (forced == "auto" and nbytes < RING_THRESHOLD):
        return alg.doubling.all_reduce
    if forced == "ring" or not alg.halving.usable(n):
        return alg.ring.all_reduce
    return alg.halving.all_reduce


def barrier_algorithm(n: int, crowded: bool = False) -> Callable[[OpLink], None]:
    """The dissemination barrier, or the tree where small all_reduces take it (crowded,
    or ``RANKWISE_ALLREDUCE=tree``): fewer wake-ups per rank when ranks outnumber CPUs."""
    forced = ALLREDUCE_ALGORITHM
    if forced == "tree" or (forced == "auto" and crowded and n >= CROWDED_TREE_FROM):
        return alg.tree.barrier
    return alg.doubling.barrier


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
        self.head = (MAGIC, VERSION, Kind.COLL, group.id, seq, fp.op, fp.dtype, fp.reduce,
                     fp.flags, fp.root, fp.count, 0, self.site.id)

    def send(self, peer: int, data: np.ndarray[Any, Any], step: int,
             lane: Lane = Lane.DATA) -> None:
        # the header is packed here rather than in Communicator.send: this runs for every
        # frame of every collective, and one pack of prepared fields is the cheapest way
        n = data.nbytes
        head = self.head
        if lane:  # rare (one clear-to-send, a final gather): re-flag a copy of the fields
            head = (*head[:8], head[8] | _LANE_FLAGS[lane], *head[9:])
        self.comm.send_frame(self.group.ranks[peer], _pack(*head, step, n),
                             data.view(np.uint8).data if n else None, self.deadline, self.site)

    def post(self, peer: int, out: np.ndarray[Any, Any], step: int,
             lane: Lane = Lane.DATA) -> Pending:
        key = (self.group.id, self.seq, self.group.ranks[peer], step, _LANE_FLAGS[lane])
        return self.comm.router.post_coll(key, out.view(np.uint8).data)

    def wait(self, handle: Any) -> None:
        assert isinstance(handle, Pending)
        activity = self.comm.doing
        activity.waiting_for = handle.src
        activity.patient = self.patient
        if handle.completed and handle.error is None:
            return  # it has landed: nothing to wait for (the common case in a pipeline)
        self.comm.wait(handle, self.deadline, self._timeout_message(handle.src),
                       patient=self.patient, quiet=self.quiet)

    def _timeout_message(self, src: int) -> Callable[[], str]:
        def describe() -> str:
            return call_timeout(self.comm.rank, self.record, f" waiting for rank {src}")

        return describe

    def reduce(self, acc: np.ndarray[Any, Any], incoming: np.ndarray[Any, Any]) -> None:
        assert self.dtype is not None and self.op is not None
        reduce_into(acc, incoming, self.dtype, self.op)

    def finish_avg(self, acc: np.ndarray[Any, Any]) -> None:
        if self.op is not None and self.op.name == "AVG":
            assert self.dtype is not None
            divide_in_place(acc, self.dtype, self.size)


class _Members:
    """``link`` narrowed to some of its group's ranks, renumbered 0..len(members)-1: the
    algorithms run unchanged over a subset of a call's group."""

    __slots__ = ("_link", "_members", "rank", "size")

    def __init__(self, link: OpLink, members: Sequence[int], rank: int) -> None:
        self._link = link
        self._members = members
        self.rank = rank
        self.size = len(members)

    def send(self, peer: int, data: Array, step: int, lane: Lane = Lane.DATA) -> None:
        self._link.send(self._members[peer], data, step, lane)

    def post(self, peer: int, out: Array, step: int, lane: Lane = Lane.DATA) -> Pending:
        return self._link.post(self._members[peer], out, step, lane)

    def wait(self, handle: Any) -> None:
        self._link.wait(handle)

    def reduce(self, acc: Array, incoming: Array) -> None:
        self._link.reduce(acc, incoming)

    def finish_avg(self, acc: Array) -> None:
        """Left to the caller: an average over the subset is not the call's average."""


class MessageEngine:
    """Runs each call as a message schedule over the communicator's transport."""

    name = "tcp"
    #: frames carry (group, seq): any number of calls may be in flight at once
    serial = False
    framed = True
    caps = HOST_CAPS

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        #: some host runs more ranks than CPUs (``transport.crowding``): fixed before any
        #: engine exists, so read once here rather than on every call
        self._crowded = bool(getattr(comm.transport, "crowded", False))

    def link(self, call: Call) -> OpLink:
        """The call's ``Link``: what algorithms (and monitored_barrier) send over."""
        link = OpLink(call.group, call.seq, call.record, call.dtype, call.op)
        link.deadline = call.deadline
        link.patient = call.patient
        link.quiet = call.quiet
        return link

    def run(self, call: Call, nbytes: int, schedule: Callable[[OpLink], None]) -> None:
        """Run ``schedule``; a large blocking call reads its own frames meanwhile, and so
        does any call of a crowded group (8+ ranks, more than CPUs): there each frame's
        hand-off from the I/O thread is a wake-up that waits for a CPU."""
        transport = self.comm.transport
        crowd = self._crowded and call.size >= CROWDED_TREE_FROM
        drive = (nbytes >= DRIVE_BYTES or crowd) and transport.drive_begin()
        try:
            schedule(self.link(call))
        finally:
            if drive:
                transport.drive_end()

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self.run(call, data.nbytes, lambda link: alg.tree.broadcast(link, data, root))

    def all_reduce(self, call: Call, data: Array) -> None:
        algorithm = all_reduce_algorithm(data.nbytes, data.size, call.size, self._crowded)
        self.run(call, data.nbytes, lambda link: algorithm(link, data))

    def all_reduce_among(self, call: Call, data: Array, members: Sequence[int]) -> None:
        """Reduce ``data`` over the group ranks ``members`` only (this rank among them), in
        this call's frames. An AVG stays a sum: the caller divides, as it knows by how many
        ranks (the tiered engine's step between hosts, ``engines.tiers``)."""
        me = members.index(call.rank)
        algorithm = all_reduce_algorithm(data.nbytes, data.size, len(members), self._crowded)
        self.run(call, data.nbytes, lambda link: algorithm(_Members(link, members, me), data))

    def reduce(self, call: Call, data: Array, root: int) -> None:
        self.run(call, data.nbytes, lambda link: alg.tree.reduce(link, data, root))

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        self.run(call, slots[0].nbytes if slots else 0,
                 lambda link: alg.ring.all_gather(link, slots))

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        self.run(call, mine.nbytes, lambda link: alg.direct.gather(link, mine, slots, root))

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        self.run(call, out.nbytes, lambda link: alg.direct.scatter(link, out, slots, root))

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        self.run(call, chunks[0].nbytes if chunks else 0,
                 lambda link: alg.ring.reduce_scatter(link, chunks))

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        # sizes vary by pair: no single size says "large", so the I/O thread reads
        self.run(call, 0, lambda link: alg.direct.all_to_all(link, outs, ins))

    def barrier(self, call: Call) -> None:
        self.run(call, 0, barrier_algorithm(call.size, self._crowded))

    def settle(self) -> None:
        """Nothing owed: every frame went out with its call."""

    def close(self) -> None:
        """Nothing of its own: the communicator owns the connections."""
