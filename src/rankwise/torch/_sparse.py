"""all_reduce of a sparse COO tensor, as gloo does it: gather every rank's indices and
values, concatenate them in rank order, coalesce (duplicate indices summed).

Why a gather and not a reduction: ranks hold different index sets (a sparse embedding's
gradient touches the rows of its own batch), so there is nothing elementwise to reduce.
Only SUM means anything on the union of index sets; gloo refuses the rest, and so does
this, before any I/O. The pieces travel as dense rankwise ``all_gather`` calls, padded to
the largest ``nnz`` (rankwise's all_gather wants equal sizes), so they get rankwise's
fingerprints and failure reports like any other call.
"""

from __future__ import annotations

import torch

from ..api import collectives as coll
from ..core.group import ProcessGroup as RankwiseGroup
from ..errors import InvalidArgument
from ..wire.buffers import ReduceOp

__all__ = ["check_sparse", "sparse_all_reduce"]


def check_sparse(tensor: torch.Tensor, rop: ReduceOp) -> None:
    """Refuse what gloo refuses, locally."""
    if tensor.layout != torch.sparse_coo:
        raise InvalidArgument(f"all_reduce: only sparse COO tensors are summed, got layout "
                              f"{tensor.layout}")
    if rop is not ReduceOp.SUM:
        raise InvalidArgument(f"all_reduce of a sparse tensor supports ReduceOp.SUM only "
                              f"(as gloo), got {rop.name}")
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"all_reduce of a sparse tensor runs on CPU tensors only, got "
                              f"{tensor.device}")


def sparse_all_reduce(tensor: torch.Tensor, rop: ReduceOp, group: RankwiseGroup) -> None:
    """Sum ``tensor`` (sparse COO) over ``group`` in place."""
    check_sparse(tensor, rop)
    mine = tensor.coalesce()
    n = group.size()
    # every rank's nnz and full shape: the shapes must agree, the nnz need not
    meta = torch.tensor([mine._nnz(), *mine.shape], dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(n)]
    coll.all_gather(metas, meta, group=group)
    shapes = {tuple(m[1:].tolist()) for m in metas}
    if len(shapes) != 1 or len(metas[0]) != len(meta):
        raise InvalidArgument(f"all_reduce of a sparse tensor: the ranks' shapes differ: "
                              f"{[tuple(m[1:].tolist()) for m in metas]}")
    counts = [int(m[0]) for m in metas]
    top = max(counts)
    indices, values = mine._indices(), mine._values()
    pad_i = torch.zeros((indices.shape[0], top), dtype=indices.dtype)
    pad_i[:, :indices.shape[1]] = indices
    pad_v = torch.zeros((top, *values.shape[1:]), dtype=values.dtype)
    pad_v[:values.shape[0]] = values
    all_i = [torch.empty_like(pad_i) for _ in range(n)]
    all_v = [torch.empty_like(pad_v) for _ in range(n)]
    coll.all_gather(all_i, pad_i, group=group)
    coll.all_gather(all_v, pad_v, group=group)
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, :c] for i, c in zip(all_i, counts, strict=True)], dim=1),
        torch.cat([v[:c] for v, c in zip(all_v, counts, strict=True)]),
        mine.shape).coalesce()
    tensor.copy_(total)

