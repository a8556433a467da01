"""Collective algorithms as pure message schedules over ``Link`` (no sockets here)."""

from . import direct, doubling, halving, ring, tree
from .link import Link

__all__ = ["Link", "direct", "doubling", "halving", "ring", "tree"]
