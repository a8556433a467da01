"""The one map from torch's errors to rankwise's, at the boundary into torch.

Why one: torch's C++ raises a bare ``RuntimeError`` for anything that goes wrong in an op,
a work or a device (a closed peer connection, an aborted communicator, a bad device
string), and rankwise's own ``DistError`` may come back through torch too. Every place in
``engines/torch`` that calls into torch names what it catches here (``TORCH_ERRORS``)
and words an op's failure here (``op_failed``), as httpx maps its transport's exceptions
in one place; the guard in core (``core.failures.explain``) then asks the control plane
why the op failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import DistError
from ..base import PeerGone

if TYPE_CHECKING:
    from ..base import Call

__all__ = ["TORCH_ERRORS", "from_torch", "op_failed"]

#: what torch raises for a failed op, work query or device (its C++ errors)
TORCH_ERRORS = (RuntimeError,)


def from_torch(err: BaseException) -> bool:
    """``err`` is torch's own error (not a ``DistError`` of rankwise's passed through
    torch, nor anything else)."""
    return isinstance(err, TORCH_ERRORS) and not isinstance(err, DistError)


def op_failed(rank: int, engine: str, call: Call, err: BaseException) -> PeerGone:
    """A torch op failed (a peer's connection closed, an aborted communicator): the
    fact core words, after asking the control plane why (a peer's traceback, its
    goodbye, a mismatch)."""
    return PeerGone(None, f"rank {rank}: {call.describe()} (collective #{call.seq} of "
                          f"{call.group.name}) failed on {engine}: {err}")
