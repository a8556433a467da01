"""The torch engine: a ``torch.distributed`` process group as a group's data plane.

Why: multi-node CPU jobs can use torch's gloo, and CUDA tensors torch's NCCL
(``engines.nccl``), while the API layer above the seam keeps rankwise's argument
checks, call sites and reports. The torch group is built directly
(``ProcessGroupGloo``/``ProcessGroupNCCL``) over the rankwise store, never through
torch's global init, so rankwise's own world is untouched. The data is not rankwise's:
the engine declares ``Caps.ring`` and reports its phases to the call's observers
(``api.observers``: the ring check rides beside the data on rankwise's control plane),
never knowing which checks there are; waits are released by the control plane
(``engines.torch.host_wait``), on NCCL without a host sync (``device_waits``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from ...store.torch_views import TorchStoreView
from ...torch_gate import check_torch
from ..base import Array, Call, Caps, Tiles, check_mode
from .device_waits import CommPlane, DeviceWaits
from .failures import TORCH_ERRORS
from .host_async import HostAsync
from .host_wait import WorkWaiter
from .ops import (
    AG_OPTS,
    ALLREDUCE_OPTS,
    AS_IS,
    FLAT_REDUCE,
    RS_OPTS,
    as_bytes,
    broadcast_options,
    nothing,
    reduce_in,
)
from .splits import check_splits
from .streams import Streams
from .tensors import HostArrays, Tensors
from .work_book import WorkBook

if TYPE_CHECKING:
    from ...core.group import ProcessGroup

__all__ = ["TORCH_GRACE", "TorchEngine"]

log = logging.getLogger("rankwise")

check_torch(torch)  # the private torch API below: a torch outside the range is refused

#: seconds ``close`` waits for a running abort of the torch group
ABORT_JOIN = 5.0
#: seconds ``close`` waits for torch's shutdown of the group; past that the group is
#: kept (``_keep``) and the process goes on leaving
SHUTDOWN_LIMIT = 10.0

#: a torch op may outlive rankwise's deadline by this much before torch's own timeout:
#: rankwise's (with its who-is-where table) must come first
TORCH_GRACE = 30.0


class TorchEngine:
    """A group's collectives on a torch process group, checked on the control plane.

    Parametrised by the torch group it drives (``pg``: gloo, or NCCL built by
    ``engines.nccl``), by how the API's buffers become tensors (``tensors``: numpy views
    or tensors as they are, see ``engines.torch.tensors``) and by how its works are waited
    for (``streams``: None, a bounded host wait (``engines.torch.host_wait``); else the
    device engine's book and stream ordering, see ``engines.torch.device_waits``)."""

    serial = True
    #: the ring check's frames are collective frames: the router must know each call
    framed = True

    def __init__(self, group: ProcessGroup, pg: Any, check: str,
                 store: TorchStoreView | None = None, *, name: str = "torch-gloo",
                 tensors: Tensors | None = None, streams: Streams | None = None) -> None:
        self.group = group
        self.pg = pg
        self.name = name
        self.tensors = HostArrays() if tensors is None else tensors
        self._raw = self.tensors.raw
        self._values = self.tensors.values
        self._as_is = self.tensors.as_is
        #: the store view ``pg`` was built on: torch holds only its C++ half, and without
        #: this reference the Python overrides vanish under it
        self.store = store
        #: the ring check's mode for this group's calls (``Caps.ring``)
        self.check_mode = "off" if group.size() == 1 else check
        #: without checks no frame of this group's calls ever arrives: the router need
        #: not be told of each call (a lock and four dict updates per call)
        self.framed = self.check_mode != "off"
        self.waiter = WorkWaiter(group.port, name)
        #: gloo on host memory: a ``Tiles`` collective runs as gloo's one-buffer op
        #: (``_allgather_base``, ``_reduce_scatter_base``), as a script on gloo runs it
        self.flat = streams is None
        #: the thread aborting ``pg`` after a failure, joined by ``close``
        self._aborting: threading.Thread | None = None
        #: the device engine's waits (NCCL and its stand-in), None on host memory
        self.device: DeviceWaits | None = None
        #: on a device, ``async_op`` calls run on the caller's thread and stream
        #: (``DeviceWaits.run_inline``); calls queued on the async worker run on the side
        #: stream after it (``DeviceWaits.adopt_async``). On host memory (gloo), the async
        #: calls that end with the op are enqueued on the caller's thread and completed by
        #: gloo's (``host_async``, ``Caps.run_split``); the others take the async worker.
        #: What the observers hold back (the ring check's batch) is sent by ``_flush``
        held: list[Callable[[], None]] = []
        self.split: HostAsync | None = None
        plane = CommPlane(self.waiter, self._flush)
        #: the book of this engine's works in flight (the device's, or the split calls':
        #: those settle themselves, ``pushed``)
        self.book = book = WorkBook(plane, lambda: self._abort(None), name=name,
                                    pushed=streams is None)
        if streams is None:
            self.split = HostAsync(book, self.waiter, plane)
            self.caps = Caps(ring=self.check_mode, held=held, run_split=self.split.run_inline)
        else:
            self.device = DeviceWaits(book, streams, plane.op_failed)
            self.caps = Caps(run_inline=self.device.run_inline,
                             adopt_async=self.device.adopt_async, ring=self.check_mode, held=held)
            book.start()
        #: device p2p (``engines.torch.p2p.NcclP2P``): ``make_p2p``'s, kept by the API
        self.p2p: Any = None
        #: the torch group for p2p from a higher rank to a lower one (see ``p2p``), made
        #: on first use by ``make_reverse`` (None: ``pg`` carries both directions)
        self.make_reverse: Callable[[], Any] | None = None
        self.reverse: Any = None
        self._reverse_lock = threading.Lock()
        group.port.on_failure.append(self._abort)

    @classmethod
    def create(cls, group: ProcessGroup, store: Any, timeout: float, *,
               prefix: str = "torch", name: str = "torch-gloo",
               tensors: Tensors | None = None, streams: Streams | None = None) -> TorchEngine:
        """On torch's gloo (``prefix`` keeps two torch groups of one rankwise group apart
        in the store: the host plane's and a test stand-in's for NCCL)."""
        from ...store.prefix import PrefixStore

        check = check_mode()  # before any I/O: a typo must not cost a rendezvous
        tstore = TorchStoreView(PrefixStore(f"engine/{group.id}/{prefix}/", store))
        opts = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=timeout + TORCH_GRACE)
        opts._devices = [tdist.ProcessGroupGloo.create_default_device()]
        pg = tdist.ProcessGroupGloo(tstore, group.group_rank, group.size(), opts)
        return cls(group, pg, check, tstore, name=name, tensors=tensors, streams=streams)

    def _flush(self) -> bool:
        """What the observers hold back, sent now (the ring check's batch: lock-free
        against the calling thread, ``RingCheck.flush``); the book's and a slow
        host wait's."""
        self.caps.send_held()
        return True

    def _abort(self, failure: BaseException | None) -> None:
        """The job failed (a mismatch, a dead peer): abort the torch group, off the I/O
        thread (a backend's abort may block). Waiters are released by ``engines.torch.host_wait``.
        gloo's and NCCL's backends both offer ``abort()`` (NCCL: ``ncclCommAbort`` on
        each communicator, which ends kernels waiting for peers)."""
        pg = self.pg
        if pg is not None and self._aborting is None:
            self._aborting = on_thread(lambda: self._abort_groups(pg), "rankwise-torch-abort")
        self.book.kick(0.0)  # the ledger's pass settles the works in flight now

    def _abort_groups(self, pg: Any) -> None:
        with self._reverse_lock:
            reverse = self.reverse
        if reverse is not None:
            try:
                reverse.abort()
            except Exception as exc:  # noqa: BLE001 - the group is given up anyway
                log.debug("rankwise: abort of the reverse p2p group: %r", exc)
        pg.abort()

    def p2p_group(self, src: int, dst: int) -> Any:
        """The torch group that carries p2p messages from group rank ``src`` to ``dst``
        (NCCL runs one pair's two directions on one stream; see ``p2p``)."""
        if src < dst or self.make_reverse is None:
            return self.pg
        with self._reverse_lock:
            if self.reverse is None:
                self.reverse = self.make_reverse()
            reverse = self.reverse
        if self._aborting is not None:  # made after the abort began: aborted too
            on_thread(reverse.abort, "rankwise-torch-abort")
        return reverse

    def make_p2p(self, link: Any, tell: Callable[[BaseException], None]) -> Any:
        """This engine's device p2p (``engines.torch.p2p.NcclP2P``) over its own torch
        groups, streams and waits: the API hands it only what the control plane owns,
        the headers' ``link`` and ``tell`` (a mismatch to every rank)."""
        from .nccl import FIRST_MIN, STAND_IN
        from .p2p import NcclP2P, StandInGroup, bounded_enqueue

        g, rank = self.group, self.group.port.rank
        assert self.device is not None, "device p2p on an engine of host memory"

        def first_contact(peer: int, enqueue: Any) -> Any:
            def abort() -> None:
                self.waiter.stuck = True
                self._abort(None)
            return bounded_enqueue(
                enqueue, failure=link.failure, timeout=max(g.timeout, FIRST_MIN),
                on_timeout=abort,
                what=lambda: f"rank {rank}: NCCL's communicator for ranks {rank} and "
                             f"{peer} of {g.name} (their first send/recv)")

        def scratch(nbytes: int) -> Any:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.tensors.device)

        def pg_for(src: int, dst: int) -> Any:
            pg = self.p2p_group(g.group_rank_of(src, "src"), g.group_rank_of(dst, "dst"))
            return StandInGroup(pg) if self.name == STAND_IN else pg

        return NcclP2P(
            rank=rank, group_rank=lambda r: g.group_rank_of(r, "peer"), pg_for=pg_for,
            waits=self.device, scratch=scratch, link=link, tell=tell,
            first_contact=first_contact, check=self.tensors.check)

    def _before(self, call: Call, *arrays: Any) -> None:
        """Before any I/O: the tensors are on the group's device, the group was not
        aborted by its book; then the call's observers' ``before`` (the check on
        the control plane)."""
        device = self.device
        if device is not None:
            self.tensors.check(call, arrays)
            if device.book.failed is not None:
                device.raise_failed()
        elif self.book.failed is not None:
            raise self.book.failed  # a split call's verdict: the group is aborted
        call.observers.before(call)

    def _run(self, call: Call, body: Callable[[], None], *arrays: Any) -> None:
        """The local checks and the observers' ``before``, then move the data."""
        self._before(call, *arrays)
        body()

    def _wait(self, call: Call, work: Any, then: bool = True,
              post: Callable[[], object] | None = None) -> None:
        """``work`` (just enqueued) bounded and waited for; ``then``: the caller's stream
        reads its result next (an inline async call orders it only then); ``post``: what
        runs once the op is done (a split host call's runs when gloo ends it)."""
        call.observers.enqueued(call)  # in flight: a full or old batch goes out now
        device = self.device
        if device is not None:  # the book's pass sends the batch if the op is slow
            self.group.port.busy(self.name, time.time())  # who-is-where: the kernel's now
            device.wait(call, work, then or post is not None)
            if post is not None:
                post()
            return
        if call.inline is not None and not then and self.split is not None:
            self.split.watch(call, work, post)  # a split async call: gloo completes it
            return
        # an op that is not done within a grace period may wait for a batched fingerprint
        # (a mismatch that hangs the data plane): send the batch then
        self.waiter.wait(call, work, self.caps.send_held)
        if post is not None:
            post()

    def _all_reduce(self, call: Call, t: torch.Tensor, then: bool = False) -> None:
        """``t`` becomes the reduction over ranks (complex products via a gather:
        gloo reduces no complex numbers); ``then``: the caller reads ``t`` next."""
        assert call.op is not None
        if t.dtype in AS_IS:  # the hot path of a small all_reduce: the op, the wait
            self._wait(call, self.pg.allreduce([t], ALLREDUCE_OPTS[call.op.name]), then)
            return
        op = call.op.name
        if t.is_complex() and op not in ("SUM", "AVG"):
            parts = [torch.empty_like(t) for _ in range(call.size)]
            parts[call.rank].copy_(t)
            self._wait(call, self.pg.allgather([[as_bytes(p) for p in parts]],
                                               [as_bytes(t).clone()]))
            acc = parts[0]
            for p in parts[1:]:
                acc.mul_(p)
            t.copy_(acc)
            return
        r, back = reduce_in(t, op)
        self._wait(call, self.pg.allreduce([r], ALLREDUCE_OPTS[op]), then,
                   None if back is nothing else back)

    # --- Engine -------------------------------------------------------------------------

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self._run(call, lambda: self._wait(call, self.pg.broadcast([self._raw(data)],
                                                                   broadcast_options(root)), False), data)

    def all_reduce(self, call: Call, data: Array) -> None:
        self._before(call, data)
        self._all_reduce(call, data if self._as_is else self._values(data, call))  # type: ignore[arg-type]

    def reduce(self, call: Call, data: Array, root: int) -> None:
        # gloo's reduce lacks some types; all_reduce gives the root the same result
        self._run(call, lambda: self._all_reduce(call, self._values(data, call)), data)

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        raw = self._raw
        self._before(call, *slots)
        mine = raw(slots[call.rank]).clone()
        if self.flat and type(slots) is Tiles:  # one buffer: gloo's own op, one tensor
            work = self._flat_op(self.pg._allgather_base, raw(slots.whole), mine, AG_OPTS)
            if work is not None:
                self._wait(call, work, False)
                return
        self._wait(call, self.pg.allgather([[raw(s) for s in slots]], [mine]), False)

    def _flat_op(self, op: Callable[..., Any], *args: Any) -> Any:
        """gloo's one-buffer ``op`` enqueued; None (and no more tries) where this torch's
        gloo lacks it: it refuses before any I/O, and the per-slot way serves."""
        try:
            return op(*args)
        except TORCH_ERRORS as err:
            if "not support" not in str(err) and "not implemented" not in str(err):
                raise
            self.flat = False
            return None

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        o = tdist.GatherOptions()
        o.rootRank = root
        outs = [[self._raw(s) for s in slots]] if slots is not None else []
        self._run(call, lambda: self._wait(call, self.pg.gather(outs, [self._raw(mine)], o),
                                           False), mine, *(slots or ()))

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        o = tdist.ScatterOptions()
        o.rootRank = root
        ins = [[self._raw(s) for s in slots]] if slots is not None else []
        self._run(call, lambda: self._wait(call, self.pg.scatter([self._raw(out)], ins, o),
                                           False), out, *(slots or ()))

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        if self.flat and type(chunks) is Tiles and call.op is not None \
                and call.op.name in FLAT_REDUCE and call.dtype is not None:
            self._before(call, *chunks)
            whole = self._values(chunks.whole, call)
            if whole.dtype in AS_IS:  # gloo's own reduce_scatter: a script's bits
                work = self._flat_op(self.pg._reduce_scatter_base,
                                     self._values(chunks[call.rank], call), whole,
                                     RS_OPTS[call.op.name])
                if work is not None:
                    self._wait(call, work, False)
                    return
            self._reduce_scatter_whole(call, chunks)
            return
        self._run(call, lambda: self._reduce_scatter_whole(call, chunks), *chunks)

    def _reduce_scatter_whole(self, call: Call, chunks: list[Array]) -> None:
        """A reduce_scatter gloo cannot run as it is (a dtype it lacks, AVG): all_reduce a
        copy of the input, keep this rank's chunk (also where the slots tile nothing)."""
        parts = [self._values(c, call) for c in chunks]
        flat = torch.cat(parts)
        self._all_reduce(call, flat, then=True)
        start = sum(len(p) for p in parts[:call.rank])
        mine = parts[call.rank]
        mine.copy_(flat[start:start + len(mine)])

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        raw = self._raw

        def body() -> None:
            if call.fp.count == -1 and self.check_mode != "off":
                self._agree_splits(call, outs, ins)
            device = self.tensors.device
            src = torch.cat([raw(i) for i in ins]) if ins else \
                torch.empty(0, dtype=torch.uint8, device=device)
            dst = torch.empty(sum(o.nbytes for o in outs), dtype=torch.uint8, device=device)
            self._wait(call, self.pg.alltoall_base(
                dst, src, [o.nbytes for o in outs], [i.nbytes for i in ins],
                tdist.AllToAllOptions()))
            at = 0
            for o in outs:
                raw(o).copy_(dst[at:at + o.nbytes])
                at += o.nbytes
        self._run(call, body, *outs, *ins)

    def _agree_splits(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        """Uneven sizes must never reach gloo (see ``engines.torch.splits``). The size table
        lives in host memory; on a device it travels through the device and back."""
        device = self.tensors.device

        def gather(row: Array, rows: list[Array]) -> None:
            mine = torch.from_numpy(row).to(device)
            parts = [torch.empty_like(mine) for _ in rows]
            self._wait(call, self.pg.allgather([parts], [mine]))
            for r, p in zip(rows, parts, strict=True):
                r[...] = p.cpu().numpy()
        check_splits(call, [i.nbytes for i in ins], [o.nbytes for o in outs], gather)

    def barrier(self, call: Call) -> None:
        self._run(call, lambda: self._wait(call, self.pg.barrier(tdist.BarrierOptions()),
                                           False))

    def settle(self) -> None:
        """The last confirmed calls' fingerprints, ahead of the goodbye."""
        self.caps.send_held()

    def close(self) -> None:
        """Shut the torch group down; one with an op abandoned in flight is kept alive
        (see ``_keep``)."""
        self.caps.send_held()  # a group destroyed alone: its last calls are checked too
        if self.p2p is not None:
            self.p2p.close()
        book = self.book
        if book is not None:  # destroying is a sync point: works in flight end first
            if not book.drain(self.group.timeout):
                self.waiter.stuck = True
            book.stop()
        listeners = self.group.port.on_failure
        if self._abort in listeners:
            listeners.remove(self._abort)
        aborting = self._aborting
        if aborting is not None:
            # never leave the abort running in torch's C++ into the group's shutdown or
            # the interpreter's exit: a process once died there (std::terminate, SIGABRT)
            # after its uncaught exception had been reported
            aborting.join(ABORT_JOIN)
        pg, self.pg = self.pg, None
        if pg is None:
            return
        reverse, self.reverse = self.reverse, None
        if self.waiter.stuck or (aborting is not None and aborting.is_alive()):
            _keep(pg)
            if reverse is not None:
                _keep(reverse)
            return
        if reverse is not None:
            ending = on_thread(reverse.shutdown, "rankwise-torch-shutdown")
            ending.join(SHUTDOWN_LIMIT)
            if ending.is_alive():
                _keep(reverse)
        # bounded like every other wait: torch's shutdown joins the backend's threads,
        # which a peer's half-finished op or connection can hold for torch's own timeout
        shutting = on_thread(pg.shutdown, "rankwise-torch-shutdown")
        shutting.join(SHUTDOWN_LIMIT)
        if shutting.is_alive():
            _keep(pg)
            log.warning("rankwise: %s on %s: torch's shutdown of the group did not finish "
                        "within %.0fs; leaving without it", self.group.name, self.name,
                        SHUTDOWN_LIMIT)


def on_thread(call: Callable[[], object], name: str) -> threading.Thread:
    """Start ``call`` (a torch group's abort or shutdown) on a daemon thread, so that
    the caller can bound its wait: either call may block in torch's C++ on a peer.
    Its errors are logged, never raised: the group is being given up anyway."""
    def run() -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - giving a group up must not raise
            log.debug("rankwise: %s: %r", name, exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _keep(pg: Any) -> None:
    """Never destroy ``pg``: destroying a torch group joins its worker threads, and one
    of them stays blocked in the abandoned op until every peer's connection closes --
    while each peer, destroying its own group, waits the same way for ours (a deadlock
    until torch's timeout). One extra reference makes the group outlive interpreter
    shutdown; the process's exit closes its sockets and releases the peers."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
