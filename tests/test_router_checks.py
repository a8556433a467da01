"""The router's ring-check path (``Router.take_checks``): a confirmed call posts no receive
for its neighbour's fingerprint, so a batch of them must be judged against our own calls,
in every order the two ranks can reach it, without parking anything nobody will take.
Pure unit tests on a ``Router``: no sockets, milliseconds.
"""

from __future__ import annotations

from rankwise.core.router import Router
from rankwise.identity.calls import Fingerprint
from rankwise.wire.frames import CHECK_ENTRY, Flag, Frame, Kind, Op, decode_checks

GROUP, PREV = 7, 1
CHECK = int(Flag.CHECK)
FP = Fingerprint(int(Op.all_reduce), 3, 1, 0, 4, 0)
NOTHING = memoryview(bytearray())


def _router() -> tuple[Router, list[tuple[Frame, Fingerprint | None]]]:
    seen: list[tuple[Frame, Fingerprint | None]] = []
    return Router(lambda frame, fp, _detail: seen.append((frame, fp))), seen


def _batch(seqs: list[int], fp: Fingerprint = FP) -> list[Frame]:
    """The frames one ``Kind.CHECKS`` frame from the previous rank stands for."""
    payload = b"".join(CHECK_ENTRY.pack(s, fp.op, fp.dtype, fp.reduce, fp.flags | CHECK,
                                        fp.root, fp.count, 99) for s in seqs)
    head = Frame(Kind.CHECKS, GROUP, seqs[-1], 0, 0, 0, 0, 0, 0, 0, 99, 0, len(payload), PREV)
    return decode_checks(head, payload)


def _parked(r: Router) -> int:
    return len(r._coll_arrived) + r._parked_total


def test_confirmed_calls_settle_in_one_pass_and_nothing_piles_up() -> None:
    r, mismatches = _router()
    for batch in range(200):
        seqs = list(range(batch * 16 + 1, batch * 16 + 17))
        for s in seqs:
            r.register_call(GROUP, s, FP)
        assert r.take_checks(_batch(seqs)) == []
    assert not mismatches and _parked(r) == 0
    # what is kept for a late receive is bounded by the call window, not the job's length
    assert len(r._groups[GROUP].checked) <= 1024


def test_a_mismatched_entry_is_reported_with_our_call() -> None:
    r, mismatches = _router()
    for s in (1, 2, 3):
        r.register_call(GROUP, s, FP)
    other = FP._replace(reduce=5)  # same sizes, another reduce op: only the check can tell
    frames = _batch([1, 2]) + _batch([3], other)
    rest = r.take_checks(frames)
    assert [f.seq for f in rest] == [3]  # the full path judges it (and names both calls)
    for f in rest:
        r.coll_header(f)
    assert [(f.seq, fp) for f, fp in mismatches] == [(3, FP)]


def test_an_early_entry_is_judged_when_the_call_is_made_and_never_leaks() -> None:
    r, mismatches = _router()
    rest = r.take_checks(_batch([1]))  # the previous rank is ahead of us
    assert [f.seq for f in rest] == [1]
    for f in rest:
        target, token = r.coll_header(f)
        if target is not None:
            r.on_payload(f, token)  # type: ignore[arg-type]
    r.register_call(GROUP, 1, FP)
    assert not mismatches and _parked(r) == 0  # a confirmed call will never take it
    # ... and a first-sight call that does post for it is answered at once
    pending = r.post_coll((GROUP, 1, PREV, 0, CHECK), NOTHING)
    assert pending.completed and pending.error is None


def test_a_first_sight_receive_posted_after_its_frame_came_completes() -> None:
    r, _ = _router()
    r.register_call(GROUP, 1, FP)
    assert r.take_checks(_batch([1])) == []  # came between the call and the receive
    pending = r.post_coll((GROUP, 1, PREV, 0, CHECK), NOTHING)
    assert pending.completed and pending.frame is not None and pending.frame.seq == 1
    # a receive posted first is finished by the batch itself
    r.register_call(GROUP, 2, FP)
    waiting = r.post_coll((GROUP, 2, PREV, 0, CHECK), NOTHING)
    assert not waiting.completed
    assert r.take_checks(_batch([2])) == []
    assert waiting.completed and waiting.error is None


def test_a_single_check_frame_nobody_waits_for_is_not_parked() -> None:
    """The previous rank saw the call first (one frame, not a batch) while this rank had
    it confirmed already: nobody posts for it, and it must not stay parked."""
    r, mismatches = _router()
    r.register_call(GROUP, 1, FP)
    (f,) = _batch([1])
    target, _ = r.coll_header(f)
    assert target is None and not mismatches and _parked(r) == 0
