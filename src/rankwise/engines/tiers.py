"""Large all-reduces in two tiers for a group spread over hosts: shared memory within each
host, tcp between them.

Why: a flat algorithm over tcp passes 2(n-1)/n of the message through the kernel on every
rank, the ranks' own host mates included. Here, with L members on each of H hosts, local
rank i reduce-scatters the vector with its host mates on shared memory, all-reduces its
1/L share with local rank i of every other host over tcp (the message engine, in the call's
own frames), and all-gathers the shares back on shared memory: 2(H-1)/(HL) of the message
crosses the kernel instead (2 hosts x 2 ranks: 8 MiB of a 16 MiB call rather than 24).
NCCL's and Horovod's hierarchical all-reduces are this shape. Every other call, and calls
below ``TIERS_BYTES``, run on the message engine as before; measurements: docs/tiers.md.

The checks stay: host mates compare fingerprints on the segment, and the frames between
hosts carry the call's, so a disagreement anywhere is found on every side.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import settings
from ..wire.buffers import ReduceOp, divide_in_place
from .base import HOST_CAPS, Array, Call
from .shm_engine import ShmEngine

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["TIERS_BYTES", "TieredEngine"]

#: all_reduce from this size goes through the tiers; smaller calls are latency-bound,
#: and the message engine's recursive doubling is one hop fewer
TIERS_BYTES = settings.integer("RANKWISE_TIERS_BYTES")

_local = threading.local()


def _padded(count: int, like: Array) -> Array:
    """A per-thread buffer of ``count`` elements of ``like``'s dtype, reused across calls
    (a fresh one per call faults its pages in each time)."""
    nbytes = count * like.itemsize
    buf: Array | None = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, np.uint8)
        _local.buf = buf
    return buf[:nbytes].view(like.dtype)


class TieredEngine:
    """The message engine, with large all-reduces split into host and cross-host tiers."""

    name = "tiers"
    #: the host tier runs on one shared segment: calls go one at a time (``Engine``)
    serial = True
    #: small calls and the cross-host tier move in the call's frames
    framed = True
    caps = HOST_CAPS

    def __init__(self, group: ProcessGroup, host: ShmEngine, layout: list[list[int]]) -> None:
        self.group = group
        self.messages = group.messages
        self.host = host
        me = group.group_rank
        self._mates = next(members for members in layout if me in members)
        self._local = self._mates.index(me)
        #: local rank i of every host, the group ranks this rank reduces with over tcp
        self._column = [members[self._local] for members in layout]

    @classmethod
    def create(cls, group: ProcessGroup, store: Any, timeout: float,
               layout: list[list[int]]) -> TieredEngine:
        """Set up this rank's host segment (collective over the group: each host's members
        build theirs; the caller agrees on the outcome across hosts)."""
        me = group.group_rank
        index = next(i for i, members in enumerate(layout) if me in members)
        part = group.part([group.ranks[r] for r in layout[index]],
                          f"{group.name} (its ranks on this host)")
        host = ShmEngine.create(part, store, timeout,
                                prefix=f"engine/{group.id}/tiers/{index}/shm")
        return cls(group, host, layout)

    def _on_host(self, call: Call, op: ReduceOp | None) -> Call:
        """``call`` as the host tier runs it: on the host's part of the group."""
        return Call(self.host.group, call.seq, call.fp, call.site, call.dtype, op,
                    call.deadline, call.started, call.shape, patient=call.patient,
                    quiet=call.quiet, label=call.label)

    def all_reduce(self, call: Call, data: Array) -> None:
        mates = len(self._mates)
        if data.nbytes < TIERS_BYTES or data.size < mates:
            self.messages.all_reduce(call, data)
            return
        assert call.dtype is not None and call.op is not None
        per = -(-data.size // mates)
        whole = data if per * mates == data.size else _padded(per * mates, data)
        if whole is not data:
            whole[:data.size] = data
            whole[data.size:] = 0
        shares = [whole[i * per:(i + 1) * per] for i in range(mates)]
        mine = shares[self._local]
        average = call.op == ReduceOp.AVG
        on_host = self._on_host(call, ReduceOp.SUM if average else call.op)
        self.host.reduce_scatter(on_host, shares)
        self.messages.all_reduce_among(call, mine, self._column)
        if average:
            divide_in_place(mine, call.dtype, call.size)
        self.host.all_gather(on_host, shares)
        if whole is not data:
            data[:] = whole[:data.size]

    # every other call: the message engine, as for any group across hosts

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self.messages.broadcast(call, data, root)

    def reduce(self, call: Call, data: Array, root: int) -> None:
        self.messages.reduce(call, data, root)

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        self.messages.all_gather(call, slots)

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        self.messages.gather(call, mine, slots, root)

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        self.messages.scatter(call, out, slots, root)

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        self.messages.reduce_scatter(call, chunks)

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        self.messages.all_to_all(call, outs, ins)

    def barrier(self, call: Call) -> None:
        self.messages.barrier(call)

    def settle(self) -> None:
        """Nothing owed: the host tier checks on the segment, the other in its frames."""

    def close(self) -> None:
        self.host.close()
