"""The router's ring-check path (``CheckBatches.take``): a confirmed call posts no receive
for its neighbour's fingerprint, so a batch of them must be judged against our own calls,
in every order the two ranks can reach it, without parking anything nobody will take.
Pure unit tests on a ``Router``: no sockets, milliseconds.
"""

from __future__ import annotations

import pytest

from rankwise.core.router import _TRIM, Router
from rankwise.identity.calls import Fingerprint
from rankwise.wire.frames import CHECK_ENTRY, CHECK_KEY, Flag, Frame, Kind, Op, WireError

GROUP, PREV = 7, 1
CHECK = int(Flag.CHECK)
FP = Fingerprint(int(Op.all_reduce), 3, 1, 0, 0, 4)
NOTHING = memoryview(bytearray())


def _router() -> tuple[Router, list[tuple[Frame, Fingerprint | None]]]:
    seen: list[tuple[Frame, Fingerprint | None]] = []
    return Router(lambda frame, fp, _detail: seen.append((frame, fp))), seen


def _entry(seq: int, fp: Fingerprint = FP, site: int = 99) -> bytes:
    return CHECK_ENTRY.pack(seq, fp.op, fp.dtype, fp.reduce, fp.flags | CHECK, fp.root,
                            fp.count, site)


def _batch(seqs: list[int], fp: Fingerprint = FP) -> tuple[Frame, bytes]:
    """One ``Kind.CHECKS`` frame from the previous rank: its header and payload."""
    payload = b"".join(_entry(s, fp) for s in seqs)
    head = Frame(Kind.CHECKS, GROUP, seqs[-1], 0, 0, 0, 0, 0, 0, 0, 99, 0, len(payload), PREV)
    return head, payload


def _call(r: Router, seq: int, confirmed: bool = True) -> None:
    """Our call #seq, as the API and the ring check register it (our site differs from
    the sender's: sites are not compared)."""
    r.register_call(GROUP, seq, FP)
    if confirmed:
        r.checks.expect(GROUP, seq, _entry(seq, site=5)[:CHECK_KEY])


def _full_path(r: Router, frames: list[Frame]) -> None:
    """What the communicator does with the entries ``CheckBatches.take`` leaves."""
    for f in frames:
        target, token = r.coll_header(f)
        if target is not None:
            r.on_payload(f, token)  # type: ignore[arg-type]


def _parked(r: Router) -> int:
    return len(r._coll_arrived) + r._parked_total


def test_confirmed_calls_settle_in_one_pass_and_nothing_piles_up() -> None:
    r, mismatches = _router()
    for batch in range(200):
        seqs = list(range(batch * 16 + 1, batch * 16 + 17))
        for s in seqs:
            _call(r, s)
        assert r.checks.take(*_batch(seqs)) == []
    assert not mismatches and _parked(r) == 0
    # what is kept for a late receive is bounded by the call window, not the job's length
    state = r._groups[GROUP]
    # (trimmed every ``_TRIM`` calls)
    assert len(state.checked) <= 1024 + _TRIM and len(state.expected) <= 1024 + _TRIM


def test_a_mismatched_entry_is_reported_with_our_call() -> None:
    r, mismatches = _router()
    for s in (1, 2, 3):
        _call(r, s)
    other = FP._replace(reduce=5)  # same sizes, another reduce op: only the check can tell
    head, payload = _batch([1, 2])
    rest = r.checks.take(head, payload + _entry(3, other))
    assert [f.seq for f in rest] == [3]  # the full path judges it (and names both calls)
    _full_path(r, rest)
    assert [(f.seq, fp) for f, fp in mismatches] == [(3, FP)]


def test_an_early_entry_is_judged_when_the_call_is_made_and_never_leaks() -> None:
    r, mismatches = _router()
    _call(r, 1)
    # the previous rank is ahead of us: its entry waits for our call, as it is
    assert r.checks.take(*_batch([2])) == []
    assert list(r._groups[GROUP].early_checks) == [2]
    _call(r, 2)
    assert not mismatches and _parked(r) == 0  # a confirmed call will never take it
    assert not r._groups[GROUP].early_checks
    # ... and a first-sight call that does post for it is answered at once
    pending = r.post_coll((GROUP, 2, PREV, 0, CHECK), NOTHING)
    assert pending.completed and pending.error is None


def test_an_early_entry_of_another_call_is_a_mismatch_once_the_call_is_made() -> None:
    r, mismatches = _router()
    _call(r, 1)
    other = FP._replace(count=8)
    assert r.checks.take(*_batch([2], other)) == []
    assert not mismatches  # nothing to judge it by yet
    _call(r, 2)
    assert [(f.seq, f.count, fp) for f, fp in mismatches] == [(2, 8, FP)]


def test_an_entry_too_far_ahead_takes_the_full_path() -> None:
    from rankwise.core.check_batches import EARLY_WINDOW

    r, mismatches = _router()
    _call(r, 1)
    far = 2 + EARLY_WINDOW
    rest = r.checks.take(*_batch([far]))
    assert [f.seq for f in rest] == [far] and not r._groups[GROUP].early_checks
    assert not mismatches


def test_a_first_sight_receive_posted_after_its_frame_came_completes() -> None:
    r, _ = _router()
    _call(r, 1)
    assert r.checks.take(*_batch([1])) == []  # came between the call and the receive
    pending = r.post_coll((GROUP, 1, PREV, 0, CHECK), NOTHING)
    assert pending.completed and pending.frame is not None and pending.frame.seq == 1
    # a receive posted first is finished by the batch itself
    _call(r, 2)
    waiting = r.post_coll((GROUP, 2, PREV, 0, CHECK), NOTHING)
    assert not waiting.completed
    assert r.checks.take(*_batch([2])) == []
    assert waiting.completed and waiting.error is None
    # first sight here, confirmed there: nothing expected, the full path finishes it
    _call(r, 3, confirmed=False)
    third = r.post_coll((GROUP, 3, PREV, 0, CHECK), NOTHING)
    _full_path(r, r.checks.take(*_batch([3])))
    assert third.completed and third.error is None


def test_a_single_check_frame_nobody_waits_for_is_not_parked() -> None:
    """The previous rank saw the call first (one frame, not a batch) while this rank had
    it confirmed already: nobody posts for it, and it must not stay parked."""
    r, mismatches = _router()
    _call(r, 1)
    head, payload = _batch([1])
    (f,) = r.checks.take(head._replace(step=1), payload)  # (any frame the batch cannot take)
    target, _ = r.coll_header(f._replace(step=0))
    assert target is None and not mismatches and _parked(r) == 0


def test_hostile_entries_are_refused_not_settled() -> None:
    r, _ = _router()
    _call(r, 1)
    head, payload = _batch([1])
    with pytest.raises(WireError):
        r.checks.take(head, payload[:-1])  # a torn entry
    bad = CHECK_ENTRY.pack(2, 250, 0, 0, CHECK, 0, 1, 0)  # an unknown op
    with pytest.raises(WireError):
        r.checks.take(head, payload + bad)
