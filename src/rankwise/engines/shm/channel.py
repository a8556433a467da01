"""Rounds on the segment: publish, wait for every rank, check fingerprints, fail loudly.

One round: each rank writes what it contributes into its own slot of the round's parity,
(on a call's first round) its fingerprint, then stores its sequence number ``s``; it then
waits until every rank's sequence number is ``>= s`` and only then reads peers' slots.

Why x86 TSO suffices for data: stores become visible in program order, so a peer that
sees our ``seq == s`` also sees the slot bytes and fingerprint written before it (numpy
copies are memcpy; glibc ends non-temporal copy loops with ``sfence``). Other machines
are refused at construction (``ShmUnavailable``).

Why two slots (ping-pong by ``s % 2``) are enough: data written for round ``s`` is read
by peers after they saw every rank at ``>= s`` and before they publish ``s + 1``. The
writer reuses that slot at round ``s + 2``, and starts writing it only after its round
``s + 1`` wait completed, i.e. after every rank published ``s + 1``, i.e. after every
rank finished its reads of round ``s``. Consequences: a peer's sequence number is
always ``s - 1``, ``s`` or ``s + 1`` while we are in round ``s`` (anything else is
corruption and raises), and data a rank writes for reading *after* round ``s + 1`` must
go into the slot of parity ``s + 1`` (the pipelined all_reduce relies on this).

Fingerprints are written on a call's first round only, into the copy of parity ``s % 2``
(a peer already in round ``s + 1`` writes the other copy, so a slow rank still reads
the right one). Every rank compares every rank's fingerprint with its own before using
any data, so a disagreement raises ``CollectiveMismatch`` on every rank, senders too.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import time
from collections.abc import Callable

from ...errors import DistError, DistTimeout, PeerFailure
from ...identity import callsite as _callsite
from ...shmem.futex import fence, futex_wait, futex_wake
from ...shmem.layout import (
    FP_COMPARED,
    FP_COUNT,
    FP_DTYPE,
    FP_FLAGS,
    FP_OP,
    FP_REDUCE,
    FP_ROOT,
    FP_SEQ,
    FP_SITE,
    H_WAKE,
    R_FP,
    R_PID,
    R_SEQ,
    R_SITE_ID,
    R_SITE_LEN,
    R_SLEEPING,
    R_STATE,
    SITE_BYTES,
    STATE_CLOSED,
    STATE_FAILED,
    STATE_LIVE,
    Layout,
)
from ...shmem.liveness import PidWatch
from ...shmem.segment import Segment
from ...shmem.waiting import Arrivals, policy_for
from ...wire.buffers import dtype_name, reduce_op_by_code
from ...wire.frames import Op
from .errors import CallTuple, ShmCallMismatch

__all__ = ["Call", "Channel"]

#: (op, dtype code, element count, reduce-op code, root, call-site id, call flags)
Call = CallTuple

_LIVENESS_EVERY = 0.1  #: seconds between pid checks while sleeping
#: the least spin once spinning stopped paying (a 2-rank round trip on separate cores
#: is a few microseconds; a peer descheduled on our core costs the whole spin per round)
_MIN_SPIN = 2e-6
#: a fingerprint as published: op, dtype, count, reduce, root, flags, round, site
#: (``layout.FP_*`` order)
_FP = struct.Struct("8q")
_FP_CMP_BYTES = FP_COMPARED * 8


def _describe(rank: int, call: Call | None, site: str) -> str:
    if call is None:
        return f"rank {rank}: <no call>"
    op, dt, count, red, root, _, _ = call
    try:
        name = Op(op).name
    except ValueError:
        name = f"op#{op}"
    parts = [f"rank {rank} called {name}(dtype={dtype_name(dt)}, count={count}"]
    r = reduce_op_by_code(red)
    if r is not None:
        parts.append(f", op=ReduceOp.{r.name}")
    if root >= 0:
        parts.append(f", root={root}")
    return "".join(parts) + f") at {site or '<unknown site>'}"


class Channel:
    """This rank's view of the segment's control records; runs rounds."""

    def __init__(self, seg: Segment[Layout], rank: int, size: int, *, check: Callable[[], None],
                 names: list[int]) -> None:
        self.seg = seg
        self.rank = rank
        self.size = size
        self.names = names  #: global rank of each group rank, for messages
        self._check = check
        lay: Layout = seg.layout
        self.w = memoryview(seg.mm).cast("B").cast("q")
        anchor = ctypes.c_char.from_buffer(seg.mm)
        self._base = ctypes.addressof(anchor)
        del anchor  # drop the buffer export so close() can unmap
        self._seq = [lay.record_word(r, R_SEQ) for r in range(size)]
        self._state = [lay.record_word(r, R_STATE) for r in range(size)]
        self._sleep = [lay.record_word(r, R_SLEEPING) for r in range(size)]
        self._wake = H_WAKE  #: the group's futex word (int64 index)
        self._wake_at = self._base + H_WAKE * 8
        self._fp = [[lay.record_word(r, R_FP[p]) for p in (0, 1)] for r in range(size)]
        #: byte offsets of our fingerprint copy and the peers', per parity
        self._my_fp_at = [8 * self._fp[rank][p] for p in (0, 1)]
        self._peer_fp_at = [[8 * self._fp[r][p] for r in range(size) if r != rank]
                            for p in (0, 1)]
        self._mm = seg.mm
        self._peers = [r for r in range(size) if r != rank]
        self._peer_seq = [self._seq[r] for r in self._peers]  #: what a wait polls
        self._peer_sleep = [self._sleep[r] for r in self._peers]
        self._peer_fp = [self._fp[r] for r in self._peers]
        self._me_seq = self._seq[rank]
        self.seq = int(self.w[self._me_seq])  # 0 for a fresh segment
        self._live = PidWatch()
        self._site_id = -1
        self._site_text = ""
        self.policy = policy_for(size)
        #: the current spin budget: adapts between ``_MIN_SPIN`` and ``policy.spin_s``
        self._spin = self.policy.spin_s
        #: how far apart ranks reach their calls lately (a call's first wait)
        self.arrivals = Arrivals(self.policy.skew_s)
        self.broken: BaseException | None = None
        self.sleeps = 0  #: futex sleeps so far (``ShmGroup.statistics``)
        #: called once when a wait passes ``slow_after`` seconds (the integrator logs a
        #: who-is-where table there; if that finds the cause, ``check`` raises it)
        self.slow_after = math.inf
        self.on_slow: Callable[[], None] | None = None
        #: called when a wait has lasted ``stuck_after`` seconds, with the seconds waited;
        #: returns the seconds until it should be called again (the deadlock probe)
        self.stuck_after = math.inf
        self.on_stuck: Callable[[float], float] | None = None
        self.w[lay.record_word(rank, R_PID)] = os.getpid()
        self.w[self._state[rank]] = STATE_LIVE

    # --- publishing ------------------------------------------------------------------

    def set_site(self, site_id: int, text: str) -> None:
        """Put the call-site text peers show in mismatch messages (only on change)."""
        if site_id == self._site_id:
            return
        lay = self.seg.layout
        raw = text.encode("utf-8", "replace")[:SITE_BYTES]
        off = lay.site(self.rank)
        self.seg.mm[off:off + len(raw)] = raw
        self.w[lay.record_word(self.rank, R_SITE_LEN)] = len(raw)
        self.w[lay.record_word(self.rank, R_SITE_ID)] = site_id
        self._site_id = site_id
        self._site_text = text

    def publish(self, call: Call | None = None) -> int:
        """Start round ``seq + 1``: write the fingerprint (first round of a call), store
        the sequence number and, when that completed the round, wake the sleeping peers.
        Returns the round's number.

        Only the rank that completes a round wakes anyone, with one FUTEX_WAKE for all:
        a sleeper woken earlier would only find a rank still missing and sleep again (at
        4 ranks, up to 3 wake-ups and context switches per round for nothing). Dekker
        again: of two ranks publishing last at once, each stores, fences, then loads the
        other's number, so at least one sees the round complete and wakes."""
        s = self.seq + 1
        w = self.w
        if call is not None:
            _FP.pack_into(self._mm, self._my_fp_at[s & 1], call[0], call[1], call[2], call[3],
                          call[4], call[6], s, call[5])
        w[self._me_seq] = s
        self.seq = s
        fence()  # our seq store before the seq and sleeping-flag loads (see futex.py)
        for i in self._peer_seq:
            if w[i] < s:
                return s  # a rank is missing: the last one to publish wakes the sleepers
        for i in self._peer_sleep:
            if w[i]:
                w[self._wake] = (2 * s) & 0x7FFFFFFF  # even: rounds; odd: state changes
                futex_wake(self._wake_at)
                break
        return s

    # --- waiting ---------------------------------------------------------------------

    def _missing(self, s: int) -> list[int]:
        w = self.w
        return [r for r in range(self.size) if w[self._seq[r]] < s]

    def wait(self, s: int, deadline: float, what: Callable[[], str],
             first: bool = False) -> None:
        """Return once every rank published round ``s``; raise DistTimeout at
        ``deadline``, PeerFailure when a rank we wait for died, failed or closed.

        Polls the peers' words only (ours is ``s`` already): spin, then yield, each
        bounded by the policy, then futex sleeps that check liveness and the deadline.
        The spin adapts: halved after each wait it did not end, doubled (up to the
        policy's) after one it did, so ranks that end up sharing a core under outside
        load stop burning the time slice their peer needs. ``first``: the call's first
        round, where ranks arrive from their own compute: while such waits have lately
        been long (``Arrivals``), it sleeps after the spin instead of yielding."""
        w = self.w
        seqs = self._peer_seq
        for i in seqs:
            if w[i] < s:
                break
        else:
            if first:
                self.arrivals.saw(0.0)
            return
        pol = self.policy
        monotonic = time.monotonic
        start = now = monotonic()
        spin_end = now + self._spin
        while now < spin_end:
            for i in seqs:
                if w[i] < s:
                    break
            else:
                # the peers ran while we spun: on cores of their own, spinning pays
                self._spin = min(pol.spin_s, 2 * self._spin)
                if first:
                    self.arrivals.saw(now - start)
                return
            now = monotonic()
        # the spin was wasted (a peer may share our core and cannot run while we spin):
        # spin less next time, down to a probe that notices when peers run beside us again
        self._spin = min(pol.spin_s, max(_MIN_SPIN, 0.5 * self._spin))
        if not first:
            self._yield_until(s, now, pol.yield_s, deadline, what)
            return
        arrivals = self.arrivals
        self._yield_until(s, now, 0.0 if arrivals.skewed else pol.yield_s, deadline, what)
        arrivals.saw(monotonic() - start)

    def _yield_until(self, s: int, now: float, budget: float, deadline: float,
                     what: Callable[[], str]) -> None:
        """``wait``'s second and third stages: yield for ``budget`` seconds, then sleep."""
        w = self.w
        seqs = self._peer_seq
        monotonic = time.monotonic
        yield_end = now + budget
        sched_yield = os.sched_yield
        while now < yield_end:
            sched_yield()
            for i in seqs:
                if w[i] < s:
                    break
            else:
                return
            now = monotonic()
        self._sleep_until(s, deadline, what)

    def _sleep_until(self, s: int, deadline: float, what: Callable[[], str]) -> None:
        w = self.w
        me = self.rank
        fut = self._wake
        addr = self._wake_at
        next_liveness = 0.0
        start = time.monotonic()
        slow_at = start + self.slow_after
        stuck_at = start + self.stuck_after
        while True:
            missing = self._missing(s)
            if not missing:
                return
            now = time.monotonic()
            if now >= slow_at and self.on_slow is not None:
                slow_at = math.inf  # once per wait
                self.on_slow()
            if now >= stuck_at and self.on_stuck is not None:
                stuck_at = now + self.on_stuck(now - start)
            self._check_peers(missing, s, what, now >= next_liveness)
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY
            self._check()
            if now >= deadline:
                ahead = ", ".join(f"rank {self.names[r]} at round {w[self._seq[r]]}"
                                  for r in missing)
                raise DistTimeout(f"{what()}: timed out on shared memory waiting for "
                                  f"{ahead} (this rank {self.names[me]} is at round {s}); "
                                  "those ranks are slow, stuck, or made a different call")
            w[self._sleep[me]] = 1
            fence()  # the flag store before the futex/seq loads
            v = w[fut]  # before the seq loads: a wake after them changes it (TSO order)
            if self._missing(s):
                self.sleeps += 1
                futex_wait(addr, v, min(self.policy.sleep_s, max(deadline - now, 1e-4)))
            w[self._sleep[me]] = 0

    def _check_peers(self, missing: list[int], s: int, what: Callable[[], str],
                     liveness: bool) -> None:
        w = self.w
        for r in self._peers:
            if w[self._seq[r]] > s + 1:  # impossible under the protocol: corrupt or foreign
                raise DistError(f"{what()}: rank {self.names[r]} is at shared-memory round "
                                f"{w[self._seq[r]]} while this rank waits for round {s}; the "
                                "segment is corrupt or shared with a foreign group")
        for r in missing:
            state = w[self._state[r]]
            if state == STATE_FAILED or state == STATE_CLOSED:
                if self._reached(r, s):
                    continue  # it published round s before it left: not missing
                how = "failed (raised an error)" if state == STATE_FAILED else "closed the group"
                raise PeerFailure(f"{what()}: rank {self.names[r]} {how} before reaching "
                                  f"round {s} on shared memory", rank=self.names[r])
            if liveness and not self._alive(r) and not self._reached(r, s):
                raise PeerFailure(f"{what()}: rank {self.names[r]} (pid "
                                  f"{w[self.seg.layout.record_word(r, R_PID)]}) died before "
                                  f"reaching round {s} on shared memory", rank=self.names[r])

    def _reached(self, r: int, s: int) -> bool:
        """Whether rank ``r`` has published round ``s``, read *after* its state: ``missing``
        was read earlier, and a rank may publish ``s``, finish its calls and close (or exit)
        in between (seen in CI under load: a 4-rank job's rank 1 raised "rank 3 closed the
        group" in a barrier rank 3 had passed). A peer stores its round before its state,
        so a round read after the state is at least as new."""
        fence()
        return bool(self.w[self._seq[r]] >= s)

    def _alive(self, r: int) -> bool:
        return self._live.alive(r, int(self.w[self.seg.layout.record_word(r, R_PID)]))

    # --- fingerprints ----------------------------------------------------------------

    def peer_call(self, r: int, s: int) -> tuple[Call, int]:
        base = self._fp[r][s & 1]
        w = self.w
        call = (w[base + FP_OP], w[base + FP_DTYPE], w[base + FP_COUNT],
                w[base + FP_REDUCE], w[base + FP_ROOT], w[base + FP_SITE], w[base + FP_FLAGS])
        return call, int(w[base + FP_SEQ])

    def last_call_of(self, r: int) -> tuple[Call, str] | None:
        """Rank r's latest published call and its site text (None before its first):
        of the two fingerprint copies, the one written for the later round."""
        rounds = [self.peer_call(r, s) for s in (0, 1)]
        call, seq = max(rounds, key=lambda cs: cs[1])
        if seq <= 0:
            return None
        return call, self.peer_site_text(r)

    def peer_site_text(self, r: int) -> str:
        """Rank r's call-site text as published (``CallSite.encode`` form), bounded."""
        lay = self.seg.layout
        n = int(self.w[lay.record_word(r, R_SITE_LEN)])
        if not 0 <= n <= SITE_BYTES:  # untrusted: bound it
            return ""
        off = lay.site(r)
        return bytes(self.seg.mm[off:off + n]).decode("utf-8", "replace")

    def peer_site(self, r: int) -> str:
        lay = self.seg.layout
        n = int(self.w[lay.record_word(r, R_SITE_LEN)])
        if not 0 <= n <= SITE_BYTES:  # untrusted: bound it
            return "<corrupt call-site text>"
        off = lay.site(r)
        text = bytes(self.seg.mm[off:off + n]).decode("utf-8", "replace")
        site_id = int(self.w[lay.record_word(r, R_SITE_ID)])
        return _callsite.CallSite.decode(site_id, text).chain if text else ""

    def check_calls(self, s: int, mine: Call, vary_count: bool = False) -> None:
        """Compare every rank's fingerprint for round ``s`` with ours (all ranks do the
        same comparisons, so all raise together). ``vary_count``: counts may differ.

        Hot path: one slice comparison per peer (``layout.FP_COMPARED``), word by word
        only where counts may differ; any difference goes to ``_disagree``."""
        par = s & 1
        if not vary_count:
            mm, n = self._mm, _FP_CMP_BYTES
            at = self._my_fp_at[par]
            ours = mm[at:at + n]
            for at in self._peer_fp_at[par]:
                if mm[at:at + n] != ours:
                    self._disagree(s, mine, vary_count)
            return
        w = self.w
        op, dtype, _, reduce, root, _, flags = mine
        for fps in self._peer_fp:
            base = fps[par]
            if w[base + FP_SEQ] != s or w[base + FP_OP] != op or w[base + FP_DTYPE] != dtype \
                    or w[base + FP_REDUCE] != reduce or w[base + FP_ROOT] != root \
                    or w[base + FP_FLAGS] != flags:
                self._disagree(s, mine, vary_count)

    def _disagree(self, s: int, mine: Call, vary_count: bool) -> None:
        """Raise for the first rank whose fingerprint for round ``s`` differs from ours."""
        for r in range(self.size):
            if r == self.rank:
                continue
            theirs, seq = self.peer_call(r, s)
            if seq != s:
                raise DistError(f"shared-memory protocol out of step: rank {self.names[r]}'s "
                                f"fingerprint is for round {seq}, expected {s}")
            same = theirs[:2] == mine[:2] and theirs[3:5] == mine[3:5] and (
                vary_count or theirs[2] == mine[2]) and theirs[6] == mine[6]
            if not same:
                raise ShmCallMismatch(
                    "ranks made different collective calls at the same point (shared-memory "
                    f"round {s}):\n  {_describe(self.names[self.rank], mine, self._site_text)}"
                    f"\n  {_describe(self.names[r], theirs, self.peer_site(r))}",
                    peer=r, theirs=theirs, their_site=self.peer_site_text(r), mine=mine)
        # the words changed between the two reads: only a foreign writer does that
        raise DistError(f"shared-memory fingerprints for round {s} changed while being read; "
                        "the segment is shared with a foreign group")

    # --- failure and shutdown --------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Mark this rank failed so waiting peers raise PeerFailure at once."""
        if self.broken is None:
            self.broken = exc
        self._set_state(STATE_FAILED)

    def _set_state(self, state: int) -> None:
        w = self.w
        w[self._state[self.rank]] = state
        fence()
        w[self._wake] = (2 * self.seq + 1) & 0x7FFFFFFF  # odd: never a round's value
        futex_wake(self._wake_at)

    def close(self) -> None:
        if self.broken is None:
            self._set_state(STATE_CLOSED)
        self._live.close()
        self.w.release()
