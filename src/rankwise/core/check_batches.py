"""The ring check's batched fingerprints, judged on the I/O thread.

Only the torch engines' ring check (``core.ring_check``) sends these: a confirmed call's
fingerprint rides in a ``Kind.CHECKS`` frame and needs only comparing with our own call.
The state lives in the router's per-group ``GroupState`` (``checked``, ``expected``),
under the router's lock; this module keeps the logic out of ``Router``.
"""

from __future__ import annotations

import struct
import threading

from ..wire.frames import CHECK_ENTRY, CHECK_KEY, Frame, Kind, decode_checks
from .mailbox import CHECK_LANE, CollKey, GroupState, Pending

__all__ = ["CheckBatches"]

_ENTRY = CHECK_ENTRY.size
_seq_of = struct.Struct("<Q").unpack_from  #: an entry's seq (its first field)
#: how many calls ahead of ours a neighbour's entry is kept as it is, to be judged when
#: our call is made (``GroupState.early_checks``); one further ahead takes the full path
EARLY_WINDOW = 1024


class CheckBatches:
    """Judges ``Kind.CHECKS`` entries against the router's calls (its lock and state)."""

    def __init__(self, lock: threading.Lock, groups: dict[int, GroupState],
                 posted: dict[CollKey, Pending]) -> None:
        self._lock = lock
        self._groups = groups
        self._coll_posted = posted

    def judged_locked(self, key: CollKey) -> Frame | None:
        """The ring-check frame for ``key`` that matched our call before this receive
        was posted (lock held), taken; None when there is none."""
        state = self._groups.get(key[0])
        if state is None or key[3] or key[4] != CHECK_LANE or \
                state.checked.get(key[1]) != key[2]:
            return None
        del state.checked[key[1]]
        return self._judged_frame(state, key[0], key[1], key[2])

    def expect(self, group: int, seq: int, key: bytes) -> None:
        """Our confirmed call #seq's ring-check entry as the neighbour must send it (the
        first ``CHECK_KEY`` bytes of ``CHECK_ENTRY``: seq and fingerprint, not the call
        site), for ``take``. No lock: one dict store is atomic, and an entry that
        comes before it is stored takes the full path, which judges it just as well."""
        state = self._groups.get(group)  # made by register_call, before any check
        if state is not None:
            state.expected[seq] = key  # trimmed with the call's other records

    def take(self, frame: Frame, payload: bytes) -> list[Frame]:
        """Judge a ``Kind.CHECKS`` frame (the neighbour's confirmed calls, see
        ``core.ring_check``) in one pass under the lock: an entry equal, byte for
        byte, to the one we expect (``expect``) is settled at once. The entries
        this cannot settle (early, mismatched, awaited by a receive of another size) are
        returned as the frames they stand for, in order, for the full path
        (``coll_header``), which validates them as hostile bytes.

        Why: a confirmed call posts no receive for its neighbour's fingerprint (it never
        waits for it), so an entry needs only comparing with our own call. Through the
        full path each entry cost a frame object, a receive posted by the caller and a
        header-and-payload hand-off here, on the I/O thread and under the GIL: on two
        cores more than the 4-byte op it checks."""
        n = len(payload)
        state = self._groups.get(frame.group)
        if state is None or n % _ENTRY:
            return decode_checks(frame, payload)  # (raises on a torn payload)
        group, src, step = frame.group, frame.src, frame.step
        rest: list[int] = []
        early: list[int] = []
        done: list[tuple[Pending, int]] = []
        with self._lock:
            expected, checked, posted = state.expected, state.checked, self._coll_posted
            last = state.last
            for off in range(0, n, _ENTRY):
                seq = _seq_of(payload, off)[0]
                if step or expected.get(seq) != payload[off:off + CHECK_KEY]:
                    if not step and last < seq <= last + EARLY_WINDOW:
                        early.append(off)  # our call #seq is not made yet
                    else:
                        rest.append(off)
                    continue
                pending = posted.pop((group, seq, src, 0, CHECK_LANE), None) \
                    if posted else None
                if pending is None:
                    checked[seq] = src  # a first-sight call may post for it yet
                elif pending.nbytes == 0:
                    done.append((pending, seq))
                else:
                    posted[(group, seq, src, 0, CHECK_LANE)] = pending
                    rest.append(off)
            judged = [(p, self._judged_frame(state, group, seq, src)) for p, seq in done]
            if early:  # validated as hostile bytes, then kept for ``register_call``
                ahead = decode_checks(frame, b"".join(payload[o:o + _ENTRY] for o in early))
                for f in ahead:
                    state.early_checks[f.seq] = f
        for pending, f in judged:
            pending.finish(f)
        if not rest:
            return []
        return decode_checks(frame, b"".join(payload[o:o + _ENTRY] for o in rest))

    @staticmethod
    def _judged_frame(state: GroupState, group: int, seq: int, src: int) -> Frame:
        fp = state.calls[seq]
        return Frame(Kind.COLL, group, seq, fp.op, fp.dtype, fp.reduce,
                     fp.flags | CHECK_LANE, fp.root, fp.count, 0, 0, 0, 0, src)
