"""The failure seam: one place that words a collective's failures.

Engines report three plain facts (``engines.base``: ``CallsDisagree``, ``PeerGone``,
``DeadlinePassed``); ``explain`` turns each into the public exception with the usual
reports, and the two sentences every rank's errors share are written here once. The
guard around each engine call (``api.collectives``) costs nothing until a fact is raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..checks.report import mismatch_report, reported_shape
from ..engines.base import CallsDisagree, DeadlinePassed, EngineFact, PeerGone
from ..errors import CollectiveMismatch, DistError, DistTimeout, PeerFailure
from ..identity.calls import mismatch_advice

if TYPE_CHECKING:
    from ..engines.base import Call
    from .communicator import Communicator

__all__ = ["explain", "mismatch_sentence", "timeout_sentence"]


def mismatch_sentence(group_name: str, seq: int, sides: Sequence[str], tail: str) -> str:
    """``collective mismatch in G, collective #S: A, but B`` followed by ``tail``."""
    return f"collective mismatch in {group_name}, collective #{seq}: " + ", but ".join(sides) \
        + tail


def timeout_sentence(rank: int, timeout: float, what: str) -> str:
    """``rank R timed out after Ns in WHAT`` (a slow-wait warning rewrites its verb)."""
    return f"rank {rank} timed out after {timeout:.0f}s in {what}"


def call_timeout(rank: int, call: Call, where: str = "") -> str:
    """The timeout sentence for collective ``call`` (``where`` ends it). It names the
    timeout with the word itself: torch's suite recognizes a backend's timeout by
    " timeout " (or gloo's " Timed out "), and the seconds keep a sub-second one exact."""
    group = call.group
    return timeout_sentence(rank, group.timeout, f"{call.describe()} (collective "
                                                 f"#{call.seq} of {group.name}, timeout "
                                                 f"{group.timeout:g}s){where}")


def explain(comm: Communicator, call: Call, fact: EngineFact) -> BaseException:
    """The public exception for ``fact``, raised by ``call`` on this rank."""
    if isinstance(fact, CallsDisagree):
        return _mismatch(comm, call, fact)
    if isinstance(fact, PeerGone):
        return cause_of(comm, call.group.ranks if fact.rank is None else [fact.rank]) \
            or PeerFailure(fact.detail, rank=fact.rank)
    assert isinstance(fact, DeadlinePassed)
    failure = comm.router.failure
    if failure is not None:  # the job failed meanwhile: that is the story
        comm.await_diagnosis()
        return comm.as_of_now(failure)
    sentence = call_timeout(comm.rank, call, fact.where)
    if fact.detail:
        sentence += f": {fact.detail}"
    if call.quiet:
        return DistTimeout(sentence)
    table = comm.mismatches.check_where(f"rank {comm.rank} timed out in "
                                        f"{call.describe()}{fact.where}")
    failure = comm.router.failure
    if failure is not None:  # the table found a mismatch no frame revealed
        return failure if isinstance(failure, DistError) else DistError(str(failure))
    return DistTimeout(sentence, report=table)


def cause_of(comm: Communicator, ranks: Sequence[int], wait: float = 1.0) -> BaseException | None:
    """The control plane's account of a lost peer among ``ranks`` (its traceback, its
    goodbye, a mismatch), waited for up to ``wait`` seconds; None when none came."""
    cause = comm.router.wait_for_any_cause(list(ranks), wait)
    if cause is None:
        return None
    comm.await_diagnosis()
    return comm.as_of_now(cause)


def _mismatch(comm: Communicator, call: Call, fact: CallsDisagree) -> CollectiveMismatch:
    group = call.group
    ours = call.describe()
    first = fact.first or (comm.rank, ours)
    reports: dict[int, dict[str, Any]] = {}
    report = ""
    if fact.report and fact.peer is not None:
        try:
            reports = comm.where_is_everyone(2.0)
            report = mismatch_report(reports, group.id, call.seq, comm.rank, fact.peer)
        except Exception as err:  # noqa: BLE001 - a report must never hide the mismatch
            report = f"(the divergence report failed: {err!r})"
    sides = [f"rank {first[0]} called {first[1]}"]
    if fact.theirs is None:  # found in the data: the detail says what differs
        message = mismatch_sentence(group.name, call.seq, [*sides, fact.detail], "")
    else:
        assert fact.peer is not None
        shape = reported_shape(reports, fact.peer, group.id, call.seq) if reports else None
        sides.append(f"rank {fact.peer} called {fact.theirs(shape)}")
        flags = call.fp.flags
        tail = ". " + (f"{fact.detail}. " if fact.detail else "") + mismatch_advice(
            flags, flags if fact.their_flags is None else fact.their_flags)
        message = mismatch_sentence(group.name, call.seq, sides, tail)
    full = message + ("\n\n" + report if report else "")
    if fact.report:
        comm.tell_mismatch(full)
    exc = CollectiveMismatch(full)
    if fact.fail_group:
        comm.router.fail_all(exc)  # every later call raises it too
    return exc
