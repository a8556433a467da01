"""The torch engine: a ``torch.distributed`` process group (gloo) as a group's data plane.

Why: multi-node CPU jobs can use torch's gloo while the API layer above the seam keeps
rankwise's argument checks, call sites and reports. The torch group is built directly
(``ProcessGroupGloo``) over the rankwise store, never through torch's global init, so
rankwise's own world is untouched. The checks ride beside the data on rankwise's
control plane (``ring_check``); waits are released by it (``torch_wait``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as tdist

from ..errors import CollectiveMismatch
from ..store.torch_views import TorchStoreView
from .base import Array, Call
from .ring_check import RingCheck, check_mode
from .torch_splits import check_splits
from .torch_wait import WorkWaiter

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["TorchEngine"]

log = logging.getLogger("rankwise")

#: PREMUL_SUM is a SUM here: the API multiplied each rank's input by its factor already
_OPS = {"SUM": tdist.ReduceOp.SUM, "AVG": tdist.ReduceOp.AVG,
        "PRODUCT": tdist.ReduceOp.PRODUCT, "MIN": tdist.ReduceOp.MIN,
        "MAX": tdist.ReduceOp.MAX, "BAND": tdist.ReduceOp.BAND,
        "BOR": tdist.ReduceOp.BOR, "BXOR": tdist.ReduceOp.BXOR,
        "PREMUL_SUM": tdist.ReduceOp.SUM}


def _allreduce_options(op: Any) -> Any:
    o = tdist.AllreduceOptions()
    o.reduceOp = op
    return o


#: one options object per reduce op, shared by every call: building one (and setting its
#: pybind ``reduceOp``) cost more than the rest of the engine's per-call Python, and torch
#: copies the options into each op it enqueues, so the objects are never changed after
_ALLREDUCE_OPTS = {name: _allreduce_options(op) for name, op in _OPS.items()}


def _t(a: Array) -> torch.Tensor:
    """Bytes for data movement: every dtype moves as uint8 (gloo lacks some types)."""
    return torch.from_numpy(a.reshape(-1).view(np.uint8))


_WIDER = {np.dtype(np.int16): np.int32, np.dtype(np.uint16): np.int32,
          np.dtype(np.uint32): np.int64}
_TOP = np.uint64(1 << 63)


def _r(a: Array, call: Call) -> torch.Tensor:
    """A tensor to reduce: bfloat16 is stored as uint16 in rankwise."""
    if call.dtype is not None and call.dtype.kind == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


#: numpy storage dtypes that ``_reduce_in`` hands to gloo as they are: the common case
#: takes no conversion and no write-back
_AS_IS = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8,
                                         np.uint8, np.int32, np.int64, np.bool_))


def _reduce_in(a: Array, call: Call) -> tuple[torch.Tensor, Callable[[], None]]:
    """A tensor gloo can reduce for ``a`` and what writes the result back into ``a``.

    gloo lacks int16 and the wide unsigned types: those are reduced widened (the
    narrowing cast back wraps exactly as the narrow arithmetic would), and uint64 as
    int64 (same bits for sums, products and bitwise ops; MIN/MAX flip the top bit so
    signed order equals unsigned order).
    """
    wider = _WIDER.get(a.dtype) if call.dtype is not None and call.dtype.kind != "bfloat16" \
        else None
    if wider is not None:
        w = a.astype(wider)

        def back() -> None:
            a[...] = w.astype(a.dtype, casting="unsafe")
        return torch.from_numpy(w), back
    if a.dtype == np.uint64:
        flip = call.op is not None and call.op.name in ("MIN", "MAX")
        if flip:
            a ^= _TOP

        def unflip() -> None:
            if flip:
                a[...] ^= _TOP
        return torch.from_numpy(a.view(np.int64)), unflip
    if a.dtype.kind == "c" and call.op is not None and call.op.name in ("SUM", "AVG"):
        return torch.from_numpy(a.view(a.real.dtype)), lambda: None
    return _r(a, call), lambda: None


#: arrays whose torch view ``_tensor_of`` keeps, at most, and their largest size
_KEPT = 64
_KEPT_BYTES = 64 * 1024

#: a torch op may outlive rankwise's deadline by this much before torch's own timeout:
#: rankwise's (with its who-is-where table) must come first
_TORCH_GRACE = 30.0


class TorchEngine:
    """A group's collectives on a torch gloo process group, checked on the control plane."""

    name = "torch-gloo"
    serial = True
    #: the ring check's frames are collective frames: the router must know each call
    framed = True

    def __init__(self, group: ProcessGroup, pg: Any, check: str,
                 store: TorchStoreView | None = None) -> None:
        self.group = group
        self.pg = pg
        #: the store view ``pg`` was built on: torch holds only its C++ half, and without
        #: this reference the Python overrides vanish under it
        self.store = store
        self.check = RingCheck(group, check)
        #: without checks no frame of this group's calls ever arrives: the router need
        #: not be told of each call (a lock and four dict updates per call)
        self.framed = self.check.mode != "off"
        self.waiter = WorkWaiter(group.comm, self.name)
        #: torch views of small arrays seen before, by id (see ``_tensor_of``)
        self._tensors: dict[int, tuple[Array, torch.Tensor]] = {}
        group.comm.router.on_failure.append(self._abort)

    @classmethod
    def create(cls, group: ProcessGroup, store: Any, timeout: float) -> TorchEngine:
        from ..store.prefix import PrefixStore

        check = check_mode()  # before any I/O: a typo must not cost a rendezvous
        tstore = TorchStoreView(PrefixStore(f"engine/{group.id}/torch/", store))
        opts = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=timeout + _TORCH_GRACE)
        opts._devices = [tdist.ProcessGroupGloo.create_default_device()]
        pg = tdist.ProcessGroupGloo(tstore, group.group_rank, group.size(), opts)
        return cls(group, pg, check, tstore)

    def _abort(self, failure: BaseException) -> None:
        """The job failed (a mismatch, a dead peer): abort the torch group, off the I/O
        thread (a backend's abort may block). Waiters are released by ``torch_wait``."""
        threading.Thread(target=self._abort_pg, name="rankwise-torch-abort",
                         daemon=True).start()

    def _abort_pg(self) -> None:
        try:
            self.pg.abort()
        except Exception as exc:  # noqa: BLE001 - aborting a failed group must not raise
            log.debug("rankwise: aborting the torch group: %r", exc)

    def _run(self, call: Call, body: Callable[[], None]) -> None:
        """Check the call on the control plane, move the data, check again."""
        self.check.before(call)
        body()
        self.check.after()

    def _tensor_of(self, a: Array) -> torch.Tensor:
        """``torch.from_numpy(a)``, kept for a small array that may come again.

        Why: the API hands the same array to every call on a tensor it has seen before
        (``api.views``); a tensor made per call cost its own Python and, freed by gloo's
        worker thread after the op, a GIL hand-off there. An entry holds ``a``, so the id
        cannot be reused while it is kept; at most ``_KEPT`` small arrays are held."""
        t = torch.from_numpy(a)
        if a.nbytes <= _KEPT_BYTES:
            if len(self._tensors) >= _KEPT:
                self._tensors.clear()
            self._tensors[id(a)] = (a, t)
        return t

    def _wait(self, call: Call, work: Any) -> None:
        self.check.enqueued()  # the op is in flight: a full or old batch goes out now
        # an op that is not done within a grace period may wait for a batched fingerprint
        # (a mismatch that hangs the data plane): send the batch then
        self.waiter.wait(call, work, self.check.flush)

    def _all_reduce(self, call: Call, a: Array) -> None:
        """``a`` becomes the reduction over ranks (complex products via a gather:
        gloo reduces no complex numbers)."""
        assert call.op is not None
        if a.dtype in _AS_IS:  # (bfloat16 is stored as uint16: not in it)
            # the hot path of a small all_reduce: the op on a kept tensor, the wait
            entry = self._tensors.get(id(a))
            t = entry[1] if entry is not None and entry[0] is a else self._tensor_of(a)
            self._wait(call, self.pg.allreduce([t], _ALLREDUCE_OPTS[call.op.name]))
            return
        o = _ALLREDUCE_OPTS[call.op.name]
        if a.dtype.kind == "c" and call.op.name not in ("SUM", "AVG"):
            parts = [np.empty_like(a) for _ in range(call.size)]
            parts[call.rank][...] = a
            self._wait(call, self.pg.allgather([[_t(p) for p in parts]], [_t(a).clone()]))
            a[...] = np.prod(np.stack(parts), axis=0)
            return
        t, back = _reduce_in(a, call)
        self._wait(call, self.pg.allreduce([t], o))
        back()

    # --- Engine -------------------------------------------------------------------------

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self._run(call, lambda: self._wait(call, self.pg.broadcast([_t(data)], _bopts(root))))

    def all_reduce(self, call: Call, data: Array) -> None:
        # ``_run`` written out: no closure on the hot path
        check = self.check
        check.before(call)
        self._all_reduce(call, data)
        check.after()

    def reduce(self, call: Call, data: Array, root: int) -> None:
        # gloo's reduce lacks some types; all_reduce gives the root the same result
        self._run(call, lambda: self._all_reduce(call, data))

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        mine = _t(slots[call.rank]).clone()
        self._run(call, lambda: self._wait(
            call, self.pg.allgather([[_t(s) for s in slots]], [mine])))

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        o = tdist.GatherOptions()
        o.rootRank = root
        outs = [[_t(s) for s in slots]] if slots is not None else []
        self._run(call, lambda: self._wait(call, self.pg.gather(outs, [_t(mine)], o)))

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        o = tdist.ScatterOptions()
        o.rootRank = root
        ins = [[_t(s) for s in slots]] if slots is not None else []
        self._run(call, lambda: self._wait(call, self.pg.scatter([_t(out)], ins, o)))

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        def body() -> None:
            # gloo has no reduce_scatter: all_reduce a copy, keep this rank's chunk
            flat = np.concatenate(chunks)
            self._all_reduce(call, flat)
            start = sum(len(c) for c in chunks[:call.rank])
            mine = chunks[call.rank]
            mine[...] = flat[start:start + len(mine)]
        self._run(call, body)

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        def body() -> None:
            if call.fp.count == -1 and self.check.mode != "off":
                self._agree_splits(call, outs, ins)
            src = torch.cat([_t(i) for i in ins]) if ins else torch.empty(0, dtype=torch.uint8)
            dst = torch.empty(sum(o.nbytes for o in outs), dtype=torch.uint8)
            self._wait(call, self.pg.alltoall_base(
                dst, src, [o.nbytes for o in outs], [i.nbytes for i in ins],
                tdist.AllToAllOptions()))
            at = 0
            for o in outs:
                _t(o).copy_(dst[at:at + o.nbytes])
                at += o.nbytes
        self._run(call, body)

    def _agree_splits(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        """Uneven sizes must never reach gloo (see ``torch_splits``)."""
        def gather(row: Array, rows: list[Array]) -> None:
            self._wait(call, self.pg.allgather([[_t(r) for r in rows]], [_t(row)]))
        try:
            check_splits(call, [i.nbytes for i in ins], [o.nbytes for o in outs], gather)
        except CollectiveMismatch as exc:
            self.group.comm.router.fail_all(exc)  # every later call raises it too
            raise

    def barrier(self, call: Call) -> None:
        self._run(call, lambda: self._wait(call, self.pg.barrier(tdist.BarrierOptions())))

    def settle(self) -> None:
        """The last confirmed calls' fingerprints, ahead of the goodbye."""
        self.check.flush()

    def close(self) -> None:
        """Shut the torch group down; one with an op abandoned in flight is kept alive
        (see ``_keep``)."""
        self.check.flush()  # a group destroyed alone: its last calls are checked too
        listeners = self.group.comm.router.on_failure
        if self._abort in listeners:
            listeners.remove(self._abort)
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self.waiter.stuck:
            _keep(pg)
            return
        try:
            pg.shutdown()
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.debug("rankwise: closing the torch group: %r", exc)


def _keep(pg: Any) -> None:
    """Never destroy ``pg``: destroying a torch group joins its worker threads, and one
    of them stays blocked in the abandoned op until every peer's connection closes --
    while each peer, destroying its own group, waits the same way for ours (a deadlock
    until torch's timeout). One extra reference makes the group outlive interpreter
    shutdown; the process's exit closes its sockets and releases the peers."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


def _bopts(root: int) -> Any:
    o = tdist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o
