"""The host wait of a torch ``Work`` (gloo-like engines, whose ``wait`` blocks the host):
in short slices, between which the control plane's failures are raised at once, the slow
and deadlock hooks run, and the deadline is kept. Why: docs/design.md, "Waiting on torch
work". NCCL's works never wait here: ``device_waits`` hands them to the group's book.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..base import Call, DeadlinePassed
from .failures import TORCH_ERRORS, op_failed
from .work_book import GRACE

if TYPE_CHECKING:
    from ...core.port import ControlPlane

__all__ = ["SLICE", "WorkWaiter"]

#: seconds between two looks at the control plane while a torch op is in flight
SLICE = 0.2
_SLICE = timedelta(seconds=SLICE)
_GRACE = timedelta(seconds=GRACE)
_SPANS = {GRACE: _GRACE, SLICE: _SLICE}


def _wait_step(work: Any, span: float) -> bool:
    """Whether ``work`` finished within ``span`` seconds (gloo: a timed ``wait``)."""
    try:
        work.wait(_SPANS.get(span) or timedelta(seconds=span))
        return True
    except TORCH_ERRORS:
        if not work.is_completed():
            return False
    work.wait()  # done now: a slice that ran out as the op ended is no error of it
    return True


class WorkWaiter:
    """Waits for one group's torch works; remembers whether one was left in flight."""

    def __init__(self, port: ControlPlane, engine_name: str) -> None:
        self.port = port
        self.engine_name = engine_name
        self._where = f" on {engine_name}"
        self._step = _wait_step
        #: a torch op was abandoned in flight (its group can no longer be destroyed
        #: cleanly: destroying it joins threads that stay blocked in that op)
        self.stuck = False

    def wait(self, call: Call, work: Any, on_slow: Callable[[], None] | None = None) -> None:
        """Return when ``work`` is done; raise the control plane's failure, a timeout
        with the who-is-where table, or the torch op's own error. ``on_slow`` runs once
        if the op is not done within ``GRACE`` seconds."""
        port = self.port
        start = time.monotonic()
        port.busy(self.engine_name, time.time())  # who-is-where: the op is torch's now
        warn_at = float("inf") if call.patient or call.quiet else start + port.warn_after
        # from ``stuck_after`` s on, ask (backing off) whether every rank is stuck: a
        # deadlock, or ranks in this very call whose other calls went to another plane
        probe_at = start + port.stuck_after
        while True:
            if port.failure is not None:
                self.stuck = not work.is_completed()
                port.raise_failure()
            now = time.monotonic()
            if now >= call.deadline:
                self.stuck = True
                raise DeadlinePassed(self._where)
            if now >= warn_at:
                warn_at = float("inf")
                port.slow(call, self._where)
                continue
            if now >= probe_at:
                probe_at = time.monotonic() + port.probe(now - start)
                continue
            span = GRACE if on_slow is not None else SLICE \
                if call.deadline - now > SLICE else max(0.001, call.deadline - now)
            try:
                if self._step(work, span):
                    return
            except TORCH_ERRORS as err:  # the op itself failed
                raise op_failed(self.port.rank, self.engine_name, call, err) from None
            if on_slow is not None:
                slow, on_slow = on_slow, None
                slow()
            # a slice ran out: look at the control plane again
