"""``RANKWISE_TRACE`` and ``RANKWISE_DUMP``: the recorders a communicator carries.

Why here and not in the communicator: the recorders are diagnosis, a layer above the
communicator; whoever builds a job (``init_process_group``, the thread harness) attaches
them, so the communicator never imports diagnosis (no import loop, no late imports).
"""

from __future__ import annotations

from typing import Any

from .. import settings
from .dump import Dumper
from .trace import Tracer

__all__ = ["attach_recorders"]


def attach_recorders(comm: Any) -> None:
    """Give ``comm`` the recorders the environment asks for (none by default)."""
    trace_dir = settings.text("RANKWISE_TRACE")
    if trace_dir:
        comm.tracer = Tracer(trace_dir, comm.rank)
    dump_dir = settings.text("RANKWISE_DUMP")
    if dump_dir:
        comm.dumper = Dumper(dump_dir, comm)
