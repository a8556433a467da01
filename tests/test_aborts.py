"""The ABORT table (checks/aborts.py): a peer's failure becomes the right exception here."""

from __future__ import annotations

import json

import pytest

from rankwise.checks.aborts import AbortInfo, abort_error, kind_of, parse_abort
from rankwise.errors import (
    CollectiveMismatch,
    DeadlockError,
    DistTimeout,
    PeerFailure,
    PeerTimeout,
)


def _error(info: dict[str, object], src: int = 1, doing: str = "") -> Exception:
    return abort_error(AbortInfo(parse_abort(json.dumps(info).encode()), src, 0, doing))


@pytest.mark.parametrize("cls", [CollectiveMismatch, DeadlockError])
def test_a_peer_that_died_of_a_job_wide_failure_is_not_the_cause(cls: type[Exception]) -> None:
    # its exit news (kind "exception") can overtake the detector's own ABORT
    exc = _error({"kind": "exception", "rank": 1, "message": f"{cls.__name__}: ranks 0-2 wait"})
    assert type(exc) is cls and "ranks 0-2 wait" in str(exc) and "raised on rank 1" in str(exc)


def test_kinds_round_trip_and_unknown_kinds_are_exceptions() -> None:
    for failure, cls in ((CollectiveMismatch("m"), CollectiveMismatch),
                         (DeadlockError("d", {0: "barrier"}), DeadlockError),
                         (DistTimeout("t"), PeerFailure)):
        assert type(_error({"kind": kind_of(failure), "rank": 2, "message": "x"})) is cls
    exc = _error({"kind": "from-the-future", "rank": 3, "message": "boom"})
    assert isinstance(exc, PeerFailure) and exc.rank == 3 and "rank 3 failed: boom" in str(exc)


def test_unreadable_payloads_are_named_not_trusted() -> None:
    for payload in (b"\xff\xfe", b"[1, 2]", b"{"):
        exc = abort_error(AbortInfo(parse_abort(payload), 4, 0, ""))
        assert isinstance(exc, PeerFailure) and "unreadable abort message" in str(exc)
    exc = _error({"kind": "exception", "rank": "not-a-rank", "message": "m" * 10**6}, src=5)
    assert isinstance(exc, PeerFailure) and exc.rank == 5 and len(str(exc)) < 250_000


def test_a_peer_that_timed_out_first_is_this_ranks_timeout_too() -> None:
    # a stopped rank: whichever survivor's deadline passes first, all raise DistTimeout
    exc = _error({"kind": "exception", "rank": 2, "message": "DistTimeout: rank 2 timed out",
                  "report": "who is where: rank 1 did not answer"}, doing="barrier()")
    assert isinstance(exc, PeerTimeout) and isinstance(exc, DistTimeout)
    assert isinstance(exc, PeerFailure) and exc.rank == 2
    assert exc.report == "who is where: rank 1 did not answer" and "rank 2 failed" in str(exc)
    bare = _error({"kind": "exception", "rank": 2, "message": "DistTimeout: no report sent"},
                  doing="barrier()")
    assert isinstance(bare, DistTimeout) and bare.report == ""
    other = _error({"kind": "exception", "rank": 2, "message": "ValueError: DistTimeout: x"},
                   doing="barrier()")
    assert not isinstance(other, DistTimeout)
    # a rank that was computing, not waiting, is told of a failure: not its own timeout
    busy = _error({"kind": "exception", "rank": 2, "message": "DistTimeout: rank 2 timed out"})
    assert type(busy) is PeerFailure
