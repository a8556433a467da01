"""The shared-memory engine: the ``Engine`` seam over ``shm.ShmGroup``.

Why an adapter: the core (``shm``) knows segments, rounds and fingerprints; the group's
control plane (``core.port``) knows why a peer failed and how to report. The core's
waits poll the port for failures, and its exceptions become the seam's plain facts,
which core words as for every engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveMismatch, DistTimeout, PeerFailure
from ..identity.calls import describe_call
from ..identity.callsite import CallSite
from .base import HOST_CAPS, Array, Call, CallsDisagree, DeadlinePassed, EngineUnavailable, PeerGone
from .shm import ShmGroup, ShmUnavailable
from .shm.errors import ShmCallMismatch

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["ShmEngine"]

#: how a timeout or slow-wait sentence on shared memory ends
_WHERE = " on shared memory"


class ShmEngine:
    """A group's collectives on one shared segment, checks and reports as on TCP."""

    name = "shm"
    #: one set of slots: calls run one at a time, in call order (see ``Engine``)
    serial = True
    #: rounds on the segment, never a collective frame
    framed = False
    caps = HOST_CAPS

    def __init__(self, group: ProcessGroup, core: ShmGroup) -> None:
        self.group = group
        self.port = port = group.port
        self.core = core
        self._call: Call | None = None  #: the call in progress, for slow-wait warnings
        #: user threads calling at once must not interleave rounds on the segment
        self._lock = threading.Lock()
        core.ch.slow_after = port.warn_after
        core.ch.on_slow = self._slow
        core.ch.stuck_after = port.stuck_after
        core.ch.on_stuck = port.probe
        port.call_sources.append(self._last_call_of)

    def _slow(self) -> None:
        call = self._call
        if call is not None:
            self.port.slow(call, _WHERE)

    def _last_call_of(self, global_rank: int) -> str:
        """What the segment shows as ``global_rank``'s latest call (for failure reports)."""
        index = self.group.index_of(global_rank)
        if index is None or self.core.closed:
            return ""
        seen = self.core.ch.last_call_of(index)
        if seen is None:
            return ""
        (op, dtype, count, reduce, root, site_id, flags), text = seen
        site = CallSite.decode(site_id, text) if text else None
        described = describe_call(op, dtype, count, reduce, root, site, flags=flags)
        return (f"{described} (on shared memory "
                f"in {self.group.name})")

    @classmethod
    def create(cls, group: ProcessGroup, store: Any, timeout: float,
               prefix: str | None = None) -> ShmEngine:
        """Set up the group's segment (collective over the group's members); ``prefix``:
        its store keys, when the group's id does not set it apart (a part of a group)."""
        port = group.port

        def control_plane_failure() -> None:
            failure = port.failure
            if failure is not None:
                raise failure

        try:
            core = ShmGroup(store, prefix or f"engine/{group.id}/shm", group.group_rank,
                            group.size(),
                            timeout=timeout, check=control_plane_failure,
                            global_ranks=group.ranks)
        except ShmUnavailable as exc:
            raise EngineUnavailable(exc.reason) from exc
        return cls(group, core)

    def _run(self, call: Call, body: Callable[..., None], *args: Any) -> None:
        """Run ``body(*args, deadline)`` alone on the segment; the core's exceptions
        become the seam's facts. (Arguments, not a closure: one allocation and frame less
        per call on the hot path.)"""
        deadline = call.deadline
        if not self._lock.acquire(blocking=False) and \
                not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DeadlinePassed(_WHERE, f"waited for another thread's call on "
                                         f"{self.group.name} to finish")
        self._call = call
        try:
            body(*args, deadline)
        except ShmCallMismatch as exc:
            raise self._mismatch(exc) from None
        except CollectiveMismatch as exc:  # found in the data (all_to_all's size table)
            if exc is self.port.failure:
                raise
            raise CallsDisagree(str(exc)) from None
        except PeerFailure as exc:
            if exc is self.port.failure:
                raise
            raise PeerGone(exc.rank, str(exc)) from None
        except DistTimeout as exc:
            raise DeadlinePassed(_WHERE, str(exc)) from None
        finally:
            self._call = None
            self._lock.release()

    def _mismatch(self, exc: ShmCallMismatch) -> CallsDisagree:
        """What the segment shows of the peer's call (element counts: its shape comes
        from its report)."""
        op, dtype, count, reduce, root, site_id, flags = exc.theirs
        their_site = CallSite.decode(site_id, exc.their_site) if exc.their_site else None

        def theirs(shape: tuple[int, ...] | None) -> str:
            return describe_call(op, dtype, count, reduce, root, their_site, shape,
                                 flags=flags)

        return CallsDisagree(exc.detail, peer=self.group.ranks[exc.peer], theirs=theirs,
                             their_flags=flags, report=True)

    # --- Engine ---------------------------------------------------------------------------

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        core = self.core
        self._run(call, core.broadcast, call.fp, call.site, data)

    def all_reduce(self, call: Call, data: Array) -> None:
        assert call.dtype is not None and call.op is not None
        core = self.core
        self._run(call, core.all_reduce, call.fp, call.site, data, call.dtype, call.op)

    def reduce(self, call: Call, data: Array, root: int) -> None:
        assert call.dtype is not None and call.op is not None
        core = self.core
        self._run(call, core.reduce, call.fp, call.site, data, call.dtype, call.op)

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        core = self.core
        self._run(call, core.all_gather, call.fp, call.site, slots[call.rank], slots)

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        core = self.core
        self._run(call, core.gather, call.fp, call.site, mine, slots)

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        core = self.core
        self._run(call, core.scatter, call.fp, call.site, out, slots)

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        assert call.dtype is not None and call.op is not None
        core = self.core
        self._run(call, core.reduce_scatter, call.fp, call.site, chunks[call.rank], chunks,
                  call.dtype, call.op)

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        core = self.core
        self._run(call, core.all_to_all, call.fp, call.site, outs, ins)

    def barrier(self, call: Call) -> None:
        core = self.core
        self._run(call, core.barrier, call.fp, call.site)

    def settle(self) -> None:
        """Nothing owed: calls are checked in the segment as they run."""

    def close(self) -> None:
        sources = self.port.call_sources
        if self._last_call_of in sources:
            sources.remove(self._last_call_of)
        self.core.close()
