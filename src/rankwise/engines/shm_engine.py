"""The shared-memory engine: the ``Engine`` seam over ``shm.ShmGroup``.

Why an adapter: the core (``shm``) knows segments, rounds and fingerprints; a rankwise
group also has a control plane (the TCP communicator) that knows why a peer failed
(its traceback, its goodbye), can ask every rank where it is, and words every error the
same way whichever engine found it. This module joins the two: the core's waits poll
the control plane for failures, and its exceptions are re-raised in the words the TCP
engine uses (both calls with their file:line for a mismatch, the peer's own account for
a failure, the who-is-where table for a timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..checks.report import mismatch_report, reported_shape
from ..errors import CollectiveMismatch, DistTimeout, PeerFailure
from ..identity.calls import describe, describe_call, mismatch_advice
from ..identity.callsite import CallSite
from .base import Array, Call
from .select import EngineUnavailable
from .shm import ShmGroup, ShmUnavailable
from .shm.errors import ShmCallMismatch

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["ShmEngine"]


class ShmEngine:
    """A group's collectives on one shared segment, checks and reports as on TCP."""

    name = "shm"
    #: one set of slots: calls run one at a time, in call order (see ``Engine``)
    serial = True
    #: rounds on the segment, never a collective frame
    framed = False

    def __init__(self, group: ProcessGroup, core: ShmGroup) -> None:
        self.group = group
        self.comm = group.comm
        self.core = core
        self._call: Call | None = None  #: the call in progress, for slow-wait warnings
        #: user threads calling at once must not interleave rounds on the segment
        self._lock = threading.Lock()
        core.ch.slow_after = self.comm.warn_after
        core.ch.on_slow = self._slow
        core.ch.stuck_after = self.comm.deadlock.after
        core.ch.on_stuck = self.comm.deadlock.probe
        self.comm.peer_call_sources.append(self._last_call_of)

    def _slow(self) -> None:
        call = self._call
        if call is None or call.patient:  # waiting on purpose (rank_zero_first followers)
            return
        self.comm.warn_slow(lambda: f"rank {self.comm.rank} timed out after "
                                    f"{self.group.timeout:.0f}s in {call.describe()} "
                                    f"(collective #{call.seq} of {self.group.name}) on "
                                    "shared memory")

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
    def create(cls, group: ProcessGroup, store: Any, timeout: float) -> ShmEngine:
        """Set up the group's segment (collective over the group's members)."""
        router = group.comm.router

        def control_plane_failure() -> None:
            failure = router.failure
            if failure is not None:
                raise failure

        try:
            core = ShmGroup(store, f"engine/{group.id}/shm", group.group_rank, group.size(),
                            timeout=timeout, check=control_plane_failure,
                            global_ranks=group.ranks)
        except ShmUnavailable as exc:
            raise EngineUnavailable(exc.reason) from exc
        return cls(group, core)

    def _run(self, call: Call, body: Callable[..., None], *args: Any) -> None:
        """Run ``body(*args, deadline)`` alone on the segment; turn the core's exceptions
        into the group's. (Arguments, not a closure: one allocation and frame less per
        call on the hot path.)"""
        deadline = call.deadline
        if not self._lock.acquire(blocking=False) and \
                not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DistTimeout(f"rank {self.comm.rank}: {call.describe()} waited "
                              f"{self.group.timeout:.0f}s for another thread's call on "
                              f"{self.group.name} to finish")
        self._call = call
        try:
            body(*args, deadline)
        except ShmCallMismatch as exc:
            raise self._mismatch(call, exc) from None
        except CollectiveMismatch as exc:  # found in the data (all_to_all's size table)
            raise CollectiveMismatch(
                f"collective mismatch in {self.group.name}, collective #{call.seq}: rank "
                f"{self.comm.rank} called {call.describe()}, but {exc}") from None
        except PeerFailure as exc:
            raise self._cause(exc) from None
        except DistTimeout as exc:
            if call.quiet or self.comm.router.failure is not None:
                raise
            table = self.comm.where_table(f"rank {self.comm.rank} timed out in "
                                          f"{call.describe()} on shared memory")
            raise DistTimeout(f"rank {self.comm.rank} timed out after "
                              f"{self.group.timeout:.0f}s in {call.describe()} "
                              f"(collective #{call.seq} of {self.group.name}): {exc}",
                              report=table) from None
        finally:
            self._call = None
            self._lock.release()

    def _cause(self, exc: PeerFailure) -> BaseException:
        """The control plane's account of a failed peer (its traceback, its goodbye)
        beats the bare fact that its shared-memory state changed."""
        cause = None
        if exc.rank is not None:
            cause = self.comm.router.wait_for_cause(exc.rank, 1.0)
        return self.comm.as_of_now(cause) if cause is not None else exc

    def _mismatch(self, call: Call, exc: ShmCallMismatch) -> CollectiveMismatch:
        """The same words as a mismatch found in a frame header, plus the divergence
        report (every rank's recent calls) when the ranks can still be asked."""
        op, dtype, count, reduce, root, site_id, flags = exc.theirs
        their_site = CallSite.decode(site_id, exc.their_site) if exc.their_site else None
        fp = call.fp
        ours = describe(fp, call.site, call.shape)
        peer = self.group.ranks[exc.peer]
        reports: dict[int, dict[str, Any]] = {}
        try:
            reports = self.comm.where_is_everyone(2.0)
            report = mismatch_report(reports, self.group.id, call.seq, self.comm.rank, peer)
        except Exception as err:  # noqa: BLE001 - a report must never hide the mismatch
            report = f"(the divergence report failed: {err!r})"
        # the segment holds element counts; the peer's shape comes from its report
        theirs = describe_call(op, dtype, count, reduce, root, their_site,
                               reported_shape(reports, peer, self.group.id, call.seq),
                               flags=flags)
        message = (f"collective mismatch in {self.group.name}, collective #{call.seq}: rank "
                   f"{self.comm.rank} called {ours}, but rank {peer} called {theirs}. "
                   + (f"{exc.detail}. " if exc.detail else "")
                   + mismatch_advice(fp.flags, flags))
        full = message + ("\n\n" + report if report else "")
        self.comm.tell_mismatch(full)
        return CollectiveMismatch(full)

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
        if self._last_call_of in self.comm.peer_call_sources:
            self.comm.peer_call_sources.remove(self._last_call_of)
        self.core.close()
