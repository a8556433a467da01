"""Shared-memory primitives (segments, futexes, pid liveness, waiting policy, layout) and
the host identity that says which ranks may share memory. The bottom layer both the shm
collective engine (``engines.shm``) and the shm transport (``transport.shm``) build on."""

from .errors import ShmUnavailable
from .host import host_identity

__all__ = ["ShmUnavailable", "host_identity"]
