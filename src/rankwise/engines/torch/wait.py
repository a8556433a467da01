"""Waiting for a torch ``Work`` the rankwise way: bounded, and released by rankwise's
control plane.

Why not ``work.wait()``: torch's gloo ``abort`` does not release a rank blocked in an op
whose peers never join (it stays blocked until gloo's own timeout or a peer's connection
closes), and NCCL's watchdog takes minutes. So the wait is cut in short slices; between
them the rank looks at what its control plane knows (a mismatch found by the ring
check, a dead or failed peer) and raises that at once. From ``RANKWISE_DEADLOCK_AFTER``
on it asks, as every rankwise wait does, whether the job is stuck for good (a deadlock,
or ranks in this call whose other calls went to another data plane: a mismatch no ring
check sees). Past ``RANKWISE_WARN_AFTER`` it logs the who-is-where table; at the group's
deadline it raises ``DistTimeout`` with it (or the mismatch the table shows).
An error of the torch op itself (a peer's connection closed) is explained by the
control plane's account when one comes within a second.

On NCCL (``poll=True``) a slice is never ``work.wait(timeout)``: a WorkNCCL whose wait
times out records a timeout error that NCCL's watchdog then acts on (it aborts the
communicator, by default tearing the process down). So the waiter polls
``work.is_completed()`` (a query of the op's CUDA event) with a short backoff and calls
the plain ``work.wait()`` once the kernel is done (it raises the op's error and orders
the current stream after NCCL's). That is the price of bounded waits on a GPU: the
calling thread (the async worker, for ``async_op``) waits on the host until the kernel
has finished, where torch's own ``wait()`` only makes the current stream wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import DistError, DistTimeout, PeerFailure
from ..base import Call

if TYPE_CHECKING:
    from ...core.communicator import Communicator

__all__ = ["GRACE", "SLICE", "WorkWaiter"]

#: seconds between two looks at the control plane while a torch op is in flight
SLICE = 0.2
_SLICE = timedelta(seconds=SLICE)
#: seconds an op may take before ``wait``'s ``on_slow`` runs (once): longer than a small
#: op takes, short enough that a hang it may explain is found at once
GRACE = 0.005
_GRACE = timedelta(seconds=GRACE)
_SPANS = {GRACE: _GRACE, SLICE: _SLICE}


def _wait_step(work: Any, span: float) -> bool:
    """Whether ``work`` finished within ``span`` seconds (gloo: a timed ``wait``)."""
    try:
        work.wait(_SPANS.get(span) or timedelta(seconds=span))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    work.wait()  # done now: a slice that ran out as the op ended is no error of it
    return True


def _poll_step(work: Any, span: float) -> bool:
    """Whether ``work`` finished within ``span`` seconds, never calling a timed ``wait``
    (NCCL, see the module's doc): polled with a backoff from 20 us to 5 ms."""
    if not work.is_completed():
        end = time.monotonic() + span
        delay = 20e-6
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            if work.is_completed():
                break
            delay = min(delay * 2, 0.005)
    work.wait()  # the op's own error, if any; the current stream waits for the kernel
    return True


class WorkWaiter:
    """Waits for one group's torch works; remembers whether one was left in flight."""

    def __init__(self, comm: Communicator, engine_name: str, poll: bool = False) -> None:
        self.comm = comm
        self.engine_name = engine_name
        self._step = _poll_step if poll else _wait_step
        #: a torch op was abandoned in flight (its group can no longer be destroyed
        #: cleanly: destroying it joins threads that stay blocked in that op)
        self.stuck = False

    def wait(self, call: Call, work: Any, on_slow: Callable[[], None] | None = None) -> None:
        """Return when ``work`` is done; raise the control plane's failure, a timeout
        with the who-is-where table, or the torch op's own error. ``on_slow`` runs once
        if the op is not done within ``GRACE`` seconds."""
        comm = self.comm
        router = comm.router
        activity = comm.activity  # who-is-where: the op is torch's now, not ours
        activity.enqueued, activity.engine = time.time(), self.engine_name
        start = time.monotonic()
        warn_at = float("inf") if call.patient or call.quiet else start + comm.warn_after
        # from ``deadlock.after`` s on, ask (backing off) whether every rank is stuck: a
        # deadlock, or ranks in this very call whose other calls went to another plane
        probe_at = start + comm.deadlock.after
        while True:
            failure = router.failure
            if failure is not None:
                self.stuck = not work.is_completed()
                comm.await_diagnosis()
                raise comm.as_of_now(failure)
            now = time.monotonic()
            if now >= call.deadline:
                self.stuck = True
                raise self._timeout(call)
            if now >= warn_at:
                warn_at = float("inf")
                comm.warn_slow(lambda: self._what(call))
                continue
            if now >= probe_at:
                probe_at = time.monotonic() + comm.deadlock.probe(now - start)
                continue
            span = GRACE if on_slow is not None else SLICE \
                if call.deadline - now > SLICE else max(0.001, call.deadline - now)
            try:
                if self._step(work, span):
                    return
            except RuntimeError as err:  # the op itself failed
                raise self._torch_error(call, err) from None
            if on_slow is not None:
                slow, on_slow = on_slow, None
                slow()
            # a slice ran out: look at the control plane again

    def _what(self, call: Call) -> str:
        return (f"rank {self.comm.rank} timed out after {call.group.timeout:.0f}s in "
                f"{call.record.describe()} (collective #{call.seq} of {call.group.name}) on "
                f"{self.engine_name}")

    def _timeout(self, call: Call) -> DistError:
        if call.quiet:
            return DistTimeout(self._what(call))
        table = self.comm.mismatches.check_where(
            f"rank {self.comm.rank} timed out in {call.record.describe()} on "
            f"{self.engine_name}")
        failure = self.comm.router.failure
        if failure is not None:  # the table found a mismatch no frame revealed
            return failure if isinstance(failure, DistError) else DistError(str(failure))
        return DistTimeout(self._what(call), report=table)

    def _torch_error(self, call: Call, exc: RuntimeError) -> BaseException:
        """The torch op failed (a peer's connection closed, ...): the control plane
        usually knows why (the peer's traceback, its goodbye, a mismatch)."""
        failure = self.comm.router.wait_for_any_cause(call.group.ranks, 1.0)
        if failure is not None:
            self.comm.await_diagnosis()
            return self.comm.as_of_now(failure)
        return PeerFailure(f"rank {self.comm.rank}: {call.record.describe()} (collective "
                           f"#{call.seq} of {call.group.name}) failed on {self.engine_name}: "
                           f"{exc}")
