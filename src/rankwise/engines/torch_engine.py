"""The torch engine: a ``torch.distributed`` process group (gloo) as a group's data plane.

Why: multi-node CPU jobs can use torch's gloo while the API layer above the seam keeps
rankwise's argument checks, call sites and reports. The torch group is built directly
(``ProcessGroupGloo``) over the rankwise store, never through torch's global init, so
rankwise's own world is untouched. First step: the control-plane fingerprint checks
(ring neighbour) are not wired yet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as tdist

from .._callsite import site_text
from .._comm import describe_call, mismatch_advice
from ..errors import CollectiveMismatch
from .base import Array, Call
from .torch_store import TorchStore

if TYPE_CHECKING:
    from .._group import ProcessGroup

__all__ = ["TorchEngine"]

log = logging.getLogger("rankwise")

_OPS = {"SUM": tdist.ReduceOp.SUM, "AVG": tdist.ReduceOp.AVG,
        "PRODUCT": tdist.ReduceOp.PRODUCT, "MIN": tdist.ReduceOp.MIN,
        "MAX": tdist.ReduceOp.MAX, "BAND": tdist.ReduceOp.BAND,
        "BOR": tdist.ReduceOp.BOR, "BXOR": tdist.ReduceOp.BXOR}


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


class TorchEngine:
    """A group's collectives on a torch gloo process group."""

    name = "torch-gloo"
    serial = True
    framed = False

    def __init__(self, group: ProcessGroup, pg: Any) -> None:
        self.group = group
        self.pg = pg

    @classmethod
    def create(cls, group: ProcessGroup, store: Any, timeout: float) -> TorchEngine:
        from ..store.prefix import PrefixStore

        tstore = TorchStore(PrefixStore(f"engine/{group.id}/torch/", store))
        opts = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=timeout)
        opts._devices = [tdist.ProcessGroupGloo.create_default_device()]
        pg = tdist.ProcessGroupGloo(tstore, group.group_rank, group.size(), opts)
        return cls(group, pg)

    def _check(self, call: Call) -> None:
        """Interim check (sync): all ranks all-gather a fixed-size fingerprint on the
        torch group before the data op, so a mismatched call raises on every rank instead
        of hanging or mixing data. The control-plane ring check is the planned successor.
        """
        if os.environ.get("RANKWISE_CHECK", "").strip().lower() == "off":
            return
        fp = call.fp
        mine = torch.tensor([fp.op, fp.dtype, fp.count, fp.reduce, fp.root,
                             call.site.id & 0x7FFFFFFFFFFFFFFF], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(call.size)]
        self._wait(self.pg.allgather([parts], [mine]))
        for r, p in enumerate(parts):
            op, dtype, count, reduce, root, site_id = (int(v) for v in p.tolist())
            same = (op, dtype, reduce, root) == (fp.op, fp.dtype, fp.reduce, fp.root) and (
                fp.count == -1 or count == -1 or count == fp.count)
            if same:
                continue
            ours = describe_call(fp.op, fp.dtype, fp.count, fp.reduce, fp.root, call.site)
            theirs = describe_call(op, dtype, count, reduce, root, site_text(site_id))
            raise CollectiveMismatch(
                f"collective mismatch in {self.group.name}, collective #{call.seq}: rank "
                f"{self.group.comm.rank} called {ours}, but rank {self.group.ranks[r]} "
                f"called {theirs}. " + mismatch_advice(fp.op, fp.root, op, root))

    def _op(self, call: Call) -> Any:
        assert call.op is not None
        return _OPS[call.op.name]

    def _wait(self, work: Any) -> None:
        work.wait()

    def _all_reduce(self, call: Call, a: Array) -> None:
        """``a`` becomes the reduction over ranks (complex products via a gather:
        gloo reduces no complex numbers)."""
        o = tdist.AllreduceOptions()
        o.reduceOp = self._op(call)
        if a.dtype.kind == "c" and call.op is not None and call.op.name not in ("SUM", "AVG"):
            parts = [np.empty_like(a) for _ in range(call.size)]
            parts[call.rank][...] = a
            self._wait(self.pg.allgather([[_t(p) for p in parts]], [_t(a).clone()]))
            a[...] = np.prod(np.stack(parts), axis=0)
            return
        t, back = _reduce_in(a, call)
        self._wait(self.pg.allreduce([t], o))
        back()

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self._check(call)
        self._wait(self.pg.broadcast([_t(data)], _bopts(root)))

    def all_reduce(self, call: Call, data: Array) -> None:
        self._check(call)
        self._all_reduce(call, data)

    def reduce(self, call: Call, data: Array, root: int) -> None:
        self._check(call)
        self._all_reduce(call, data)  # gloo's reduce lacks some types; same result

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        self._check(call)
        self._wait(self.pg.allgather([[_t(s) for s in slots]], [_t(slots[call.rank]).clone()]))

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        self._check(call)
        o = tdist.GatherOptions()
        o.rootRank = root
        outs = [[_t(s) for s in slots]] if slots is not None else []
        self._wait(self.pg.gather(outs, [_t(mine)], o))

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        self._check(call)
        o = tdist.ScatterOptions()
        o.rootRank = root
        ins = [[_t(s) for s in slots]] if slots is not None else []
        self._wait(self.pg.scatter([_t(out)], ins, o))

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        self._check(call)
        # gloo has no reduce_scatter: all_reduce a copy, keep this rank's chunk
        flat = np.concatenate(chunks)
        self._all_reduce(call, flat)
        start = sum(len(c) for c in chunks[:call.rank])
        mine = chunks[call.rank]
        mine[...] = flat[start:start + len(mine)]

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        self._check(call)
        src = torch.cat([_t(i) for i in ins]) if ins else torch.empty(0, dtype=torch.uint8)
        dst = torch.empty(sum(o.nbytes for o in outs), dtype=torch.uint8)
        self._wait(self.pg.alltoall_base(dst, src, [o.nbytes for o in outs],
                                         [i.nbytes for i in ins], tdist.AllToAllOptions()))
        at = 0
        for o in outs:
            _t(o).copy_(dst[at:at + o.nbytes])
            at += o.nbytes

    def barrier(self, call: Call) -> None:
        self._check(call)
        self._wait(self.pg.barrier(tdist.BarrierOptions()))

    def close(self) -> None:
        for name in ("abort", "shutdown"):
            fn = getattr(self.pg, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - closing must not raise
                    log.debug("rankwise: closing the torch group: %r", exc)
                return


def _bopts(root: int) -> Any:
    o = tdist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o
