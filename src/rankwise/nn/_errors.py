"""Errors raised by DistributedDataParallel (all are :class:`rankwise.errors.DistError`)."""

from __future__ import annotations

from rankwise.errors import DistError, InvalidArgument

__all__ = ["DDPError", "ParameterMismatch"]


class DDPError(DistError):
    """DDP could not keep the ranks' gradients in step (e.g. unused parameters)."""


class ParameterMismatch(DDPError, InvalidArgument):
    """Ranks wrapped models whose parameters differ in name, shape or dtype."""
