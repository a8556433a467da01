"""The exceptions rankwise raises.

Every failure a user can meet is one of these, so that ``except rankwise.DistError``
catches all of them and nothing from the socket layer leaks through unexplained::

    DistError (RuntimeError)
     ├─ DistTimeout                a bounded wait ran out; carries the who-is-where report
     ├─ PeerFailure                another rank died, raised, or left; carries its rank
 │   └─ PeerTimeout            ...of a timeout of its own (also a DistTimeout)
     ├─ CollectiveMismatch         ranks called different collectives/shapes/dtypes/roots/ops
     ├─ DeadlockError              every live rank is blocked in a rankwise call and none can
     │                             ever be woken (a wait-for cycle across groups and p2p)
     ├─ DistNetworkError           connect/listen/send failures (port in use, unreachable master)
     ├─ RendezvousError            init could not form the group (missing or duplicate ranks,
     │                             disagreeing world sizes)
     ├─ RecoveryError              shrink/grow could not agree on a new membership (the
     │                             survivors disagree who is alive, one never came)
     ├─ StoreError                 the rendezvous store failed or refused a request
     │   └─ AuthError              a peer did not prove it holds the shared token
     └─ InvalidArgument (also ValueError)   misuse caught locally, before any I/O

Lower-level exceptions (``OSError``, ``socket.timeout``) are translated at the transport
edge with ``raise ... from exc`` so the original stays visible in the traceback.
Messages name the ranks, the operation, the sequence number and the user's file:line
where they are known, and say what to do.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CollectiveMismatch",
    "DeadlockError",
    "DistError",
    "DistNetworkError",
    "DistTimeout",
    "InvalidArgument",
    "PeerFailure",
    "PeerTimeout",
    "RecoveryError",
    "RendezvousError",
    "StoreError",
]


class DistError(RuntimeError):
    """Base class of every rankwise error."""


class DistTimeout(DistError, TimeoutError):
    """A bounded wait ran out.

    ``report`` holds the who-is-where table gathered from the other ranks when it
    could be gathered, else an empty string.
    """

    def __init__(self, message: str, report: str = "") -> None:
        super().__init__(message + (f"\n{report}" if report else ""))
        self.report = report


class PeerFailure(DistError):
    """Another rank failed (raised, crashed, was killed) or left while we needed it.

    ``rank`` is the global rank of the failed peer, ``remote_traceback`` the text of
    its exception when it could send one, ``last_collective`` its last recorded call.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        remote_traceback: str = "",
        last_collective: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.last_collective = last_collective


class PeerTimeout(PeerFailure, DistTimeout):
    """Another rank's bounded wait ran out first and it left; its report comes along.

    A rank that waits on a stopped peer would have timed out too: whichever deadline
    passes first, every survivor raises a ``DistTimeout`` (and a ``PeerFailure``).
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        remote_traceback: str = "",
        last_collective: str = "",
        report: str = "",
    ) -> None:
        super().__init__(message, rank, remote_traceback, last_collective)
        self.report = report


class CollectiveMismatch(DistError):
    """Ranks made different calls at the same point of a group's collective sequence."""


class DeadlockError(DistError):
    """Every live rank is blocked in a rankwise call and none of them can ever proceed.

    Raised on every rank at once, about a second after the last rank blocked, instead of
    waiting for the timeout: the message names each rank's call, group and file:line and
    whom it waits for. ``ranks`` maps each global rank to that one-line description.
    """

    def __init__(self, message: str, ranks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.ranks = dict(ranks or {})
        #: every rank's who-is-where report when the deadlock was confirmed (post-mortems)
        self.reports: dict[int, dict[str, object]] = {}


class DistNetworkError(DistError):
    """A connection could not be made, kept or used."""


class RendezvousError(DistError):
    """``init_process_group`` could not assemble a consistent group."""


class RecoveryError(DistError):
    """``shrink``/``grow`` could not agree on the world that goes on: the survivors
    disagree about who is alive, a rank never joined the agreement within its timeout,
    or this rank was left out of the agreed world (docs/recovery.md)."""


class StoreError(DistError):
    """The rendezvous key-value store failed or refused a request."""


class AuthError(StoreError):
    """A connection failed the shared-token challenge (wrong or missing token)."""


class InvalidArgument(DistError, ValueError):
    """A call was misused; detected locally before any communication happened."""
