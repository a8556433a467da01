"""The one exception of its own shared memory adds.

``ShmUnavailable`` is raised at construction only, before any collective ran, on every
rank alike; the integrator turns it into a fallback to the TCP engine with one log line
(its message names the fix, e.g. ``docker run --shm-size=1g``). It subclasses
``DistError`` so that an unhandled one is still a rankwise error.
"""

from __future__ import annotations

from ..errors import DistError

__all__ = ["ShmUnavailable"]


class ShmUnavailable(DistError):
    """Shared memory cannot be used for this group here; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
