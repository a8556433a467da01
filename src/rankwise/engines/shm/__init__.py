"""Shared-memory collective core: ``ShmGroup`` runs a group's collectives inline on one
shared segment per group (see ``group.py`` for the contract, ``channel.py`` for the
protocol, ``segment.py`` for how the segment is created, shared and never leaked).

Environment: ``RANKWISE_SHM_SLOT_BYTES`` (slot size, default 1 MiB), ``RANKWISE_SHM_METHOD``
(auto | memfd | file), ``RANKWISE_SHM_SPIN_US`` / ``RANKWISE_SHM_YIELD_US`` (waiting).
"""

from ...shmem.errors import ShmUnavailable
from .group import ShmGroup

__all__ = ["ShmGroup", "ShmUnavailable"]
