"""``ShmGroup``: collectives run inline on one shared segment per group (the calling
thread copies into its slot, publishes a round, reads the peers' slots). Buffers are flat
numpy arrays, results in place; raises ``ShmCallMismatch``/``CollectiveMismatch``,
``DistTimeout`` or ``PeerFailure``; not thread-safe (one call at a time). The full contract
and the measurements: docs/design.md, "Shared-memory collectives".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ... import settings
from ...errors import DistError, InvalidArgument
from ...identity import callsite as _callsite
from ...identity.calls import Fingerprint
from ...shmem.errors import ShmUnavailable
from ...shmem.futex import supported
from ...shmem.layout import Layout
from ...shmem.segment import StoreLike, open_segment
from ...shmem.waiting import usable_cpus
from ...wire.buffers import DType, ReduceOp, divide_in_place
from ...wire.frames import Op
from .channel import Call, Channel
from .chunks import ALIGN, padding
from .copying import SLOW_MIN, Copier, address
from .errors import ShmCallMismatch
from .plans import PLANS, PipelinePlan, SmallPlan, pipeline_plan, small_plan
from .reduce import reduce_rows, rows_reducer

__all__ = ["DEFAULT_SLOT_BYTES", "SMALL_BYTES", "ShmGroup"]

Array = npt.NDArray[Any]

#: slot size per rank and parity; measured sizes: docs/design.md, "Shared-memory collectives"
DEFAULT_SLOT_BYTES = 1 << 20
#: when ranks outnumber CPUs, larger rounds win (up to a point; same section)
OVERSUBSCRIBED_SLOT_BYTES = 2 << 20
OVERSUBSCRIBED_GROUP_BYTES = 64 << 20
#: all_reduce up to this size: one round, every rank reduces everything itself
SMALL_BYTES = 64 << 10


class ShmGroup:
    """One process group's shared-memory collective engine (see the module docstring).

    ``store``/``prefix``: rendezvous (a ``rankwise.store.Store`` and a key prefix unique
    to this group). ``slot_bytes`` (default ``RANKWISE_SHM_SLOT_BYTES``, else 1 MiB; when
    ranks outnumber CPUs 2 MiB, less beyond 16 ranks so the group maps <= 64 MiB; plus
    ``chunks.padding``) is the
    size of each of the 2 data slots per rank; ``method`` ("auto", "memfd", "file";
    default ``RANKWISE_SHM_METHOD`` or "auto") how the segment is shared. ``timeout``
    bounds the setup. ``global_ranks[r]`` names group rank r in messages.
    Raises ``ShmUnavailable`` when shared memory cannot be used here.
    """

    def __init__(self, store: StoreLike, prefix: str, rank: int, size: int, *,
                 timeout: float, slot_bytes: int | None = None, method: str | None = None,
                 check: Callable[[], None] = lambda: None,
                 global_ranks: Sequence[int] | None = None) -> None:
        if not supported():
            raise ShmUnavailable("the shared-memory engine relies on x86_64 memory ordering "
                                 "(TSO) and Linux futexes; this machine is not x86_64 Linux")
        if not 0 <= rank < size:
            raise InvalidArgument(f"rank {rank} is not in a group of {size}")
        slot = slot_bytes or settings.integer("RANKWISE_SHM_SLOT_BYTES", (
            min(OVERSUBSCRIBED_SLOT_BYTES, OVERSUBSCRIBED_GROUP_BYTES // (2 * size))
            if size > usable_cpus() else DEFAULT_SLOT_BYTES))
        slot = max(65536, slot // 65536 * 65536) + padding(size)
        how = method or settings.choice("RANKWISE_SHM_METHOD")
        self.rank = rank
        self.size = size
        self.seg = open_segment(store, prefix, rank, size, slot_bytes=slot, method=how,
                                timeout=timeout, kind=Layout)
        self.slot_bytes = self.seg.layout.slot_bytes
        names = list(global_ranks) if global_ranks is not None else list(range(size))
        self.ch = Channel(self.seg, rank, size, check=check, names=names)
        lay = self.seg.layout
        #: (rank, parity, byte) view of all data slots; slots sit at a fixed stride
        self._grid: Array = np.ndarray((size, 2, lay.slot_bytes), np.uint8, self.seg.mm,
                                       lay.slot(0, 0), (2 * lay.slot_bytes, lay.slot_bytes, 1))
        self._slots: list[list[Array]] = [[self._grid[r, p] for p in (0, 1)]
                                          for r in range(size)]
        self._grid_at = address(self._grid[0, 0])  #: where slot (0, 0) is mapped here
        self._region = self.slot_bytes // size // ALIGN * ALIGN
        self._small_bytes = min(SMALL_BYTES, self.slot_bytes)
        self._plans: dict[tuple[int, int, int], SmallPlan] = {}
        self._pipelines: dict[tuple[int, int, int], PipelinePlan] = {}
        self._copier = Copier()
        self._closed = False
        self._current: Call = (0, 0, 0, 0, -1, 0, 0)  #: the call in progress

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def method(self) -> str:
        """How the segment is shared: "memfd" or "file"."""
        return self.seg.method

    # --- plumbing --------------------------------------------------------------------

    def _begin(self, fp: Fingerprint, site: _callsite.CallSite, count: int) -> Call:
        if self._closed:
            raise DistError("this shared-memory group is closed")
        if self.ch.broken is not None:
            raise DistError("this shared-memory group is unusable after an earlier error: "
                            f"{self.ch.broken}") from self.ch.broken
        if site.id != self.ch._site_id:
            self.ch.set_site(site.id, site.encode())
        call = (fp.op, fp.dtype, count, fp.reduce, fp.root, site.id, fp.flags)
        self._current = call
        return call

    def _describe(self) -> str:
        """The call in progress, for error messages (built only when one is raised)."""
        call = self._current
        try:
            name = Op(call[0]).name
        except ValueError:
            name = f"op#{call[0]}"
        return f"{name} on rank {self.ch.names[self.rank]}"

    def _round(self, call: Call, first: bool, deadline: float,
               vary_count: bool = False) -> int:
        """Publish and wait for one round; check fingerprints on a call's first round.
        ``long``: the peers have a chunk to move before they publish (``Channel.wait``).
        Returns the slot parity the round's data is in."""
        ch = self.ch
        s = ch.publish(call if first else None)
        ch.wait(s, deadline, self._describe, first)
        if first:
            ch.check_calls(s, call, vary_count)
        return s & 1

    def _slot_at(self, rank: int, parity: int, offset: int) -> int:
        """The address of byte ``offset`` of slot (``rank``, ``parity``) (``copying``)."""
        return self._grid_at + (2 * rank + parity) * self.slot_bytes + offset

    def _parity(self) -> int:
        """Parity of the next round: where to write before publishing it."""
        return (self.ch.seq + 1) & 1

    def _rows(self, parity: int, offset: int, count: int, st: np.dtype[Any]) -> Array:
        """Every rank's slot of ``parity``, from byte ``offset``, ``count`` elements of
        ``st``, as one strided (ranks, count) view (see ``reduce.py``)."""
        return self._grid[:, parity, offset:offset + count * st.itemsize].view(st)

    def _root(self, fp: Fingerprint) -> int:
        if not 0 <= fp.root < self.size:
            raise InvalidArgument(f"root {fp.root} is not a rank of this group of {self.size}")
        return fp.root

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.ch.fail(exc)
            raise

    @staticmethod
    def _u8(a: Array) -> Array:
        return a.reshape(-1).view(np.uint8)

    # --- collectives -----------------------------------------------------------------

    def barrier(self, fp: Fingerprint, site: _callsite.CallSite, deadline: float) -> None:
        # a barrier's count is its name's code (named barriers, rank_zero_first blocks)
        call = self._begin(fp, site, fp.count)

        def run() -> None:
            self._round(call, True, deadline)
        self._guard(run)

    def broadcast(self, fp: Fingerprint, site: _callsite.CallSite, arr: Array,
                  deadline: float) -> None:
        """Root's ``arr`` into every rank's ``arr``, one slot-sized chunk per round."""
        call = self._begin(fp, site, arr.size)
        root = self._root(fp)

        def run() -> None:
            a = self._u8(arr)
            nb, S = a.size, self.slot_bytes
            put = self._copier.copy
            for i in range(max(1, -(-nb // S))):
                lo, hi = i * S, min(nb, (i + 1) * S)
                p = self._parity()
                if self.rank == root:
                    put(self._slots[root][p][:hi - lo], a[lo:hi])
                self._round(call, i == 0, deadline)
                if self.rank != root:
                    put(a[lo:hi], self._slots[root][p][:hi - lo])
        self._guard(run)

    def all_reduce(self, fp: Fingerprint, site: _callsite.CallSite, arr: Array, dtype: DType,
                   op: ReduceOp, deadline: float) -> None:
        """Reduce ``arr`` across ranks in place, bit-identically on every rank."""
        self._reduce(self._begin(fp, site, arr.size), arr, dtype, op, deadline, None)

    def reduce(self, fp: Fingerprint, site: _callsite.CallSite, arr: Array, dtype: DType,
               op: ReduceOp, deadline: float) -> None:
        """Reduce into the root's ``arr``; other ranks' ``arr`` are left unchanged."""
        call = self._begin(fp, site, arr.size)
        self._reduce(call, arr, dtype, op, deadline, self._root(fp))

    def _reduce(self, call: Call, arr: Array, dtype: DType, op: ReduceOp, deadline: float,
                root: int | None) -> None:
        """(all_)reduce under ``_guard``'s rule, written out: the hot path of small calls
        saves the closure."""
        try:
            self._reduce_unguarded(call, arr, dtype, op, deadline, root)
        except BaseException as exc:
            self.ch.fail(exc)
            raise

    def _reduce_unguarded(self, call: Call, arr: Array, dtype: DType, op: ReduceOp,
                          deadline: float, root: int | None) -> None:
        a = arr.reshape(-1)
        if a.nbytes <= self._small_bytes:
            # one round: everyone (or the root) reduces every slot itself, in rank order
            plan = (self._plans.get((a.size, dtype.code, op.code))
                    or self._plan(a.size, dtype, op))
            p = (self.ch.seq + 1) & 1
            if a.nbytes < SLOW_MIN:
                plan.mine[p][...] = a
            else:
                self._copier.copy_to(plan.mine[p], plan.mine_at[p], a)
            self._round(call, True, deadline)
            if root is None or root == self.rank:
                plan.reduce(plan.rows[p], a)
                if plan.avg:
                    divide_in_place(a, dtype, self.size)
            return
        self._pipelined(call, a, dtype, op, deadline, root)

    def _plan(self, count: int, dtype: DType, op: ReduceOp) -> SmallPlan:
        if len(self._plans) >= PLANS:
            self._plans.clear()
        plan = small_plan(self._slots, self._slot_at, self.rank, self.size, count, dtype, op)
        self._plans[(count, dtype.code, op.code)] = plan
        return plan

    def _pipelined(self, call: Call, a: Array, dtype: DType, op: ReduceOp, deadline: float,
                   root: int | None) -> None:
        """Large (all_)reduce: one round per chunk, plus one (see ``chunks.py``).

        Round t publishes chunk t's input (every part but this rank's own) and chunk
        t-1's part this rank reduced. After it, rank j reduces part j of chunk t (its
        own contribution straight from its buffer, in rank order: the same bits
        everywhere) into its own part's place in its slot of the *next* parity (read
        after round t+1, see channel.py), and everyone gathers chunk t-1's parts,
        starting at the next rank's so that ranks do not all read the same lines.
        The slot side of all that is fixed per (size, dtype, first parity): made once
        (``PipelinePlan``), as the small path's views are.
        """
        p0 = self._parity()
        plan = self._pipelines.get((a.size, dtype.code, p0)) or self._pipeline(a.size, dtype, p0)
        me, n = self.rank, self.size
        gather = root is None or root == me
        reducer = rows_reducer(dtype, op)
        avg = op.name == "AVG"
        raw = a.view(np.uint8)
        # where ``a`` is, for the Copier's slow-path check (not needed where it never bounces)
        at = address(a) if self._copier.bounces and a.nbytes >= SLOW_MIN else 0
        copy_at = self._copier.copy_at
        first = True
        for sends, reduce, gathers in plan.rounds:
            for view, view_at, lo, hi in sends:  # byte ranges of ``a``
                copy_at(view, view_at, raw[lo:hi], at + lo)
            self._round(call, first, deadline)
            first = False
            if reduce is not None:
                lo, hi, rows, acc = reduce  # element range of ``a``
                xs = list(rows)
                xs[me] = a[lo:hi]
                reducer(xs, acc)
                if avg:
                    divide_in_place(acc, dtype, n)
            if gather:
                for lo, hi, view, view_at in gathers:  # byte ranges of ``a``
                    copy_at(raw[lo:hi], at + lo, view, view_at)

    def _pipeline(self, count: int, dtype: DType, p0: int) -> PipelinePlan:
        """The slot views and offsets of a pipelined (all_)reduce (see ``_pipelined``)."""
        if len(self._pipelines) >= PLANS:
            self._pipelines.clear()
        plan = pipeline_plan(self._slots, self._slot_at, self.rank, self.size,
                             self.slot_bytes, count, dtype, p0)
        self._pipelines[(count, dtype.code, p0)] = plan
        return plan

    def all_gather(self, fp: Fingerprint, site: _callsite.CallSite, arr: Array,
                   outs: Sequence[Array], deadline: float) -> None:
        """Every rank's ``arr`` into ``outs[rank]`` on every rank (``outs`` may be views
        of one tensor: all_gather_into_tensor)."""
        call = self._begin(fp, site, arr.size)
        self._check_outs(outs, arr.nbytes, "all_gather")
        self._guard(lambda: self._gather(call, arr, outs, deadline, None))

    def gather(self, fp: Fingerprint, site: _callsite.CallSite, arr: Array,
               outs: Sequence[Array] | None, deadline: float) -> None:
        """Every rank's ``arr`` into the root's ``outs[rank]`` (``outs`` only on root)."""
        call = self._begin(fp, site, arr.size)
        root = self._root(fp)
        if self.rank == root:
            if outs is None:
                raise InvalidArgument("gather: the root needs a list of outputs")
            self._check_outs(outs, arr.nbytes, "gather")
        self._guard(lambda: self._gather(call, arr, outs or [], deadline, root))

    def _check_outs(self, outs: Sequence[Array], nbytes: int, what: str) -> None:
        if len(outs) != self.size or any(o.nbytes != nbytes for o in outs):
            raise InvalidArgument(f"{what}: needs {self.size} outputs of {nbytes} bytes, got "
                                  f"{[o.nbytes for o in outs]}")

    def _gather(self, call: Call, arr: Array, outs: Sequence[Array], deadline: float,
                root: int | None) -> None:
        a = self._u8(arr)
        nb, S, me = a.size, self.slot_bytes, self.rank
        dst = [self._u8(o) for o in outs]
        put = self._copier.copy
        for i in range(max(1, -(-nb // S))):
            lo, hi = i * S, min(nb, (i + 1) * S)
            p = self._parity()
            put(self._slots[me][p][:hi - lo], a[lo:hi])
            self._round(call, i == 0, deadline)
            if root is None or root == me:
                for j in range(self.size):
                    put(dst[j][lo:hi], a[lo:hi] if j == me else self._slots[j][p][:hi - lo])

    def scatter(self, fp: Fingerprint, site: _callsite.CallSite, out: Array,
                ins: Sequence[Array] | None, deadline: float) -> None:
        """The root's ``ins[rank]`` into every rank's ``out`` (``ins`` only on root)."""
        call = self._begin(fp, site, out.size)
        root = self._root(fp)
        if self.rank == root:
            if ins is None:
                raise InvalidArgument("scatter: the root needs a list of inputs")
            self._check_outs(ins, out.nbytes, "scatter")

        def run() -> None:
            o = self._u8(out)
            src = [self._u8(x) for x in ins] if ins is not None and self.rank == root else []
            nb, R, me = o.size, self._region, self.rank
            put = self._copier.copy
            for i in range(max(1, -(-nb // R))):
                lo, hi = i * R, min(nb, (i + 1) * R)
                p = self._parity()
                if me == root:
                    slot = self._slots[me][p]
                    for j in range(self.size):
                        if j != me:
                            put(slot[j * R:j * R + hi - lo], src[j][lo:hi])
                self._round(call, i == 0, deadline)
                if me == root:
                    put(o[lo:hi], src[me][lo:hi])
                else:
                    put(o[lo:hi], self._slots[root][p][me * R:me * R + hi - lo])
        self._guard(run)

    def reduce_scatter(self, fp: Fingerprint, site: _callsite.CallSite, out: Array,
                       ins: Sequence[Array], dtype: DType, op: ReduceOp,
                       deadline: float) -> None:
        """``out`` = reduction over ranks of their ``ins[rank]`` (``ins`` may be views of
        one tensor: reduce_scatter_tensor)."""
        call = self._begin(fp, site, out.size)
        self._check_outs(ins, out.nbytes, "reduce_scatter")

        def run() -> None:
            o = out.reshape(-1)
            st, n, me = dtype.storage, self.size, self.rank
            item = st.itemsize
            src = [x.reshape(-1) for x in ins]
            R = self._region // item  # elements per region
            put = self._copier.copy
            for i in range(max(1, -(-o.size // R))):
                lo, hi = i * R, min(o.size, (i + 1) * R)
                p = self._parity()
                slot = self._slots[me][p]
                for j in range(n):
                    put(slot[j * R * item:(j * R + hi - lo) * item], src[j][lo:hi].view(np.uint8))
                self._round(call, i == 0, deadline)
                acc = o[lo:hi]
                reduce_rows(self._rows(p, me * R * item, hi - lo, st), acc, dtype, op)
                if op.name == "AVG":
                    divide_in_place(acc, dtype, n)
        self._guard(run)

    def all_to_all(self, fp: Fingerprint, site: _callsite.CallSite, outs: Sequence[Array],
                   ins: Sequence[Array], deadline: float) -> None:
        """``ins[j]`` of every rank i into rank j's ``outs[i]``; sizes may differ per pair
        (all_to_all_single with split sizes). The first round carries every rank's send
        and receive sizes and, beside them, the first piece of each pair's bytes: every
        rank checks every pair before it reads any data, and all agree from the table
        how many rounds follow (none, for messages that fit a first piece)."""
        n, me = self.size, self.rank
        if len(outs) != n or len(ins) != n:
            raise InvalidArgument(f"all_to_all: needs {n} inputs and {n} outputs")
        call = self._begin(fp, site, -1)

        def run() -> None:
            table = 2 * n * 8
            head = -(-table // ALIGN) * ALIGN
            first_piece = (self.slot_bytes - head) // n // ALIGN * ALIGN
            src = [self._u8(x) for x in ins]
            dst = [self._u8(o) for o in outs]
            put = self._copier.copy

            def send_pieces(p: int, lo: int, width: int, at: int) -> None:
                """Bytes ``lo:lo+width`` for each peer j into region j (from ``at``)."""
                slot = self._slots[me][p]
                for j in range(n):
                    if j != me and lo < src[j].size:
                        hi = min(src[j].size, lo + width)
                        put(slot[at + j * width:at + j * width + hi - lo], src[j][lo:hi])

            def take_pieces(p: int, lo: int, width: int, at: int) -> None:
                """Each peer i's bytes ``lo:lo+width`` for us from its region ``me``."""
                for i in range(n):
                    if i != me and lo < dst[i].size:
                        hi = min(dst[i].size, lo + width)
                        put(dst[i][lo:hi],
                            self._slots[i][p][at + me * width:at + me * width + hi - lo])

            p = self._parity()
            self._slots[me][p][:table] = np.array(
                [x.nbytes for x in ins] + [o.nbytes for o in outs], np.int64).view(np.uint8)
            send_pieces(p, 0, first_piece, head)
            self._round(call, True, deadline, vary_count=True)
            send = self._agreed_sizes(p, table, call)  # before any of the data is read
            put(dst[me], src[me])
            take_pieces(p, 0, first_piece, head)
            R = self._region
            longest = int(max((send[i, j] for i in range(n) for j in range(n) if i != j),
                              default=0))
            for t in range(-(-max(0, longest - first_piece) // R)):
                lo = first_piece + t * R
                p = self._parity()
                send_pieces(p, lo, R, 0)
                self._round(call, False, deadline)
                take_pieces(p, lo, R, 0)
        self._guard(run)

    def _agreed_sizes(self, p: int, table: int, call: Call) -> Array:
        """all_to_all's size tables (untrusted bytes) from every rank's slot of parity
        ``p``: the (sender, receiver) byte counts, once every pair agrees; else raise."""
        n, me = self.size, self.rank
        m = np.stack([self._slots[r][p][:table].view(np.int64) for r in range(n)])
        send, recv = m[:, :n], m[:, n:]
        if (m < 0).any() or (m > 1 << 50).any():
            raise DistError("all_to_all: corrupt size table in shared memory")
        if (send != recv.T).any():
            bad = [(i, j) for i in range(n) for j in range(n) if send[i, j] != recv[j, i]]
            i, j = bad[0]
            detail = (f"rank {self.ch.names[i]} sends {send[i, j]} bytes to rank "
                      f"{self.ch.names[j]}, which expects {recv[j, i]} bytes from it "
                      f"({len(bad)} disagreeing pair(s))")
            peer = j if i == me else i
            theirs, _ = self.ch.peer_call(peer, self.ch.seq)
            raise ShmCallMismatch(f"all_to_all: {detail}", peer=peer, theirs=theirs,
                                  their_site=self.ch.peer_site_text(peer), mine=call,
                                  detail=detail)
        return send

    # --- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Tell peers we left (they raise PeerFailure if they still wait on us), unmap."""
        if self._closed:
            return
        self._closed = True
        self.ch.close()
        self._plans.clear()
        self._pipelines.clear()
        self._slots = []
        del self._grid
        try:
            self.seg.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last reference

    def __enter__(self) -> ShmGroup:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> dict[str, int | str]:
        return {"rounds": self.ch.seq, "slot_bytes": self.slot_bytes, "method": self.method,
                "spin_ns": int(self.ch.policy.spin_s * 1e9),
                "yield_ns": int(self.ch.policy.yield_s * 1e9), "sleeps": self.ch.sleeps}
