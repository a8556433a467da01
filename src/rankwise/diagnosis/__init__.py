"""Diagnosis: making hangs and desyncs precise errors (issue 4).

- ``rank_zero_first`` / ``main_process_first`` and ``monitored_barrier``: sync helpers
  that fail loudly instead of pairing with the wrong barrier.
- ``who_is_where()``: the table a slow wait logs (``RANKWISE_WARN_AFTER``), on demand.
- ``report``: who-is-where reports, divergence analysis, p2p cycle detection.
- ``trace``: ``RANKWISE_TRACE=dir`` timelines and ``python -m rankwise.diagnosis.trace``.
- ``set_enabled(False)`` / ``RANKWISE_DIAGNOSIS=0``: no call-site capture (benchmarks).
"""

from __future__ import annotations

from ..api.world import current
from ..identity.callsite import enabled, set_enabled
from .sync import main_process_first, monitored_barrier, rank_zero_first

__all__ = ["enabled", "main_process_first", "monitored_barrier", "rank_zero_first",
           "set_enabled", "who_is_where"]


def who_is_where(timeout: float = 2.0) -> str:
    """Ask every rank where it is now and return the table (bounded by ``timeout``)."""
    comm = current().comm
    return comm.where_table(f"asked by rank {comm.rank}", timeout)
