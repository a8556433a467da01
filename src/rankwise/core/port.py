"""The control-plane port: all an engine may reach of the rest of the job.

Why a port: engines used to read sixteen members of the communicator (its router among
them); each such reach tied an engine to core's internals. Engines now see five things:
the job's failure state, the real cause of a lost peer, the slow-wait and deadlock hooks,
a place to describe peers' calls for failure reports, and the fingerprint ring for
engines whose data rankwise does not own. They report failures as plain facts
(``engines.base``) that ``core.failures`` words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .failures import call_timeout, cause_of, explain
from .ring_check import RingCheck

if TYPE_CHECKING:
    from ..engines.base import Call, EngineFact
    from .communicator import Communicator
    from .group import ProcessGroup

__all__ = ["ControlPlane"]


class ControlPlane:
    """One process's port, shared by every engine of every group."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._router = comm.router
        self.rank = comm.rank
        #: failure state: listeners told (once) of the job's first failure
        self.on_failure: list[Callable[[BaseException], None]] = comm.router.on_failure
        #: peer call source: engines that see peers' calls without frames describe a
        #: peer's latest call here, by global rank ("" when they have not seen one)
        self.call_sources: list[Callable[[int], str]] = comm.peer_call_sources
        #: slow and deadlock hooks: seconds before a wait warns, and before it asks
        #: whether the job is stuck (``probe(waited)`` returns the seconds to the next ask)
        self.warn_after = comm.warn_after
        self.stuck_after = comm.deadlock.after
        self.probe = comm.deadlock.probe

    # --- failure state --------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The job's failure (a mismatch, a failed peer), None while all is well."""
        return self._router.failure

    def raise_failure(self) -> None:
        """Raise the job's failure, if any, as this rank should see it now."""
        failure = self._router.failure
        if failure is not None:
            self._comm.await_diagnosis()
            raise self._comm.as_of_now(failure)

    def fail(self, exc: BaseException) -> None:
        """Fail the whole job with ``exc``: every wait and every later call raises it."""
        self._router.fail_all(exc)

    def explain(self, call: Call, fact: EngineFact) -> BaseException:
        """The public exception for ``fact`` of ``call``, for an engine that learns of a
        call's failure after the call returned (the NCCL engine's book: outside the API's
        guard, which words the facts raised inside a call)."""
        return explain(self._comm, call, fact)

    def cause(self, ranks: Sequence[int], wait: float = 1.0) -> BaseException | None:
        """The real cause of a lost peer among ``ranks`` (see ``core.failures.cause_of``)."""
        return cause_of(self._comm, ranks, wait)

    # --- slow and deadlock hooks ----------------------------------------------------------

    def busy(self, engine: str, started: float) -> None:
        """Who-is-where: this rank's current call is in ``engine``'s hands now."""
        activity = self._comm.doing
        activity.enqueued, activity.engine = started, engine

    def slow(self, call: Call, where: str) -> None:
        """``call`` has waited ``warn_after`` seconds: log who is where (not for a call
        that waits on purpose)."""
        if not call.patient:
            rank = self.rank
            self._comm.warn_slow(lambda: call_timeout(rank, call, where))

    # --- fingerprints, for engines whose data rankwise does not own ----------------------

    def fingerprints(self, group: ProcessGroup, mode: str) -> RingCheck:
        """``group``'s fingerprint ring (``core.ring_check``) in ``mode``."""
        return RingCheck(group, mode)
