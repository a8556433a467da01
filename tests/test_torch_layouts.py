"""Every list layout torch hands the backend, and group names, against gloo (issue 26).

torch's Python wrappers pass lists of lists whose order is easy to transpose silently
(``all_gather_coalesced``'s ``output_tensor_lists`` is ``[rank][i]``). Each rank makes a
gloo default group and a rankwise group over the same ranks, runs every case on both with
the same inputs, and the parent compares the outputs exactly. Inputs differ per rank and
per slot, and shapes differ per slot, so a transposed or shuffled layout cannot agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.procs

from test_ddp_harness import free_port, run_ranks

pytestmark = pytest.mark.procs

Case = Callable[[Any, int, int], Any]


def _val(rank: int, slot: int, shape: tuple[int, ...]) -> Any:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + 100 * rank + 10 * slot).reshape(shape)


def _all_gather_coalesced(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    shapes = [(1,), (2,), (3, 2)]  # shapes differ per input: a transpose cannot fit
    inputs = [_val(rank, i, s) for i, s in enumerate(shapes)]
    outs = [[torch.zeros(s) for s in shapes] for _ in range(world)]
    tdist.all_gather_coalesced(outs, inputs, group=pg)
    return [[t.tolist() for t in row] for row in outs]


def _all_gather_coalesced_same_shape(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    inputs = [torch.tensor([10.0 * rank + i]) for i in range(2)]
    outs = [[torch.zeros(1) for _ in range(2)] for _ in range(world)]
    tdist.all_gather_coalesced(outs, inputs, group=pg)
    return [[t.tolist() for t in row] for row in outs]


def _all_gather(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    outs = [torch.zeros(3) for _ in range(world)]
    tdist.all_gather(outs, _val(rank, 0, (3,)), group=pg)
    return [t.tolist() for t in outs]


def _all_gather_into_tensor(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    out = torch.zeros(world * 2, 3)
    tdist.all_gather_into_tensor(out, _val(rank, 0, (2, 3)), group=pg)
    return out.tolist()


def _gather(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    dst = world - 1
    outs = [torch.zeros(2, 2) for _ in range(world)] if rank == dst else None
    tdist.gather(_val(rank, 0, (2, 2)), outs, dst=dst, group=pg)
    return [t.tolist() for t in outs] if outs else None


def _scatter(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    src = world - 1
    parts = [_val(rank, r, (2,)) for r in range(world)] if rank == src else None
    out = torch.zeros(2)
    tdist.scatter(out, parts, src=src, group=pg)
    return out.tolist()


def _reduce_scatter(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    out = torch.zeros(2)
    tdist.reduce_scatter(out, [_val(rank, r, (2,)) for r in range(world)], group=pg)
    return out.tolist()


def _reduce_scatter_tensor(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    out = torch.zeros(2)
    tdist.reduce_scatter_tensor(out, _val(rank, 0, (2 * world,)), group=pg)
    return out.tolist()


#: gloo's list ``alltoall`` (the reference) exists from torch 2.12 on
_GLOO_LIST_ALLTOALL = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)


def _all_to_all(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    # gloo wants one size for every piece; the values say who sent which slot
    ins = [_val(rank, d, (2,)) for d in range(world)]
    outs = [torch.zeros(2) for _ in range(world)]
    if pg is None and not _GLOO_LIST_ALLTOALL:  # torch 2.11's gloo: the single form instead
        flat = torch.zeros(2 * world)
        tdist.all_to_all_single(flat, torch.cat(ins), group=pg)
        return [t.tolist() for t in flat.split(2)]
    tdist.all_to_all(outs, ins, group=pg)
    return [t.tolist() for t in outs]


def _all_to_all_single(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    in_splits = [d + 1 for d in range(world)]
    out_splits = [rank + 1] * world
    out = torch.zeros(sum(out_splits))
    tdist.all_to_all_single(out, _val(rank, 0, (sum(in_splits),)), out_splits, in_splits,
                            group=pg)
    return out.tolist()


def _all_reduce_coalesced(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    ts = [_val(rank, 0, (2,)), _val(rank, 1, (3, 1))]
    tdist.all_reduce_coalesced(ts, group=pg)
    return [t.tolist() for t in ts]


def _broadcast_and_reduce(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    b = _val(rank, 0, (3,))
    tdist.broadcast(b, src=world - 1, group=pg)
    r = _val(rank, 1, (3,))
    tdist.reduce(r, dst=0, op=tdist.ReduceOp.MAX, group=pg)
    return [b.tolist(), r.tolist() if rank == 0 else None]


def _objects(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    got: list[Any] = [None] * world
    tdist.all_gather_object(got, {"rank": rank, "pad": "x" * (rank * 7)}, group=pg)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    tdist.gather_object(("g", rank), gathered, dst=0, group=pg)
    lst: list[Any] = [f"from {rank}", rank]
    tdist.broadcast_object_list(lst, src=world - 1, group=pg)
    out: list[Any] = [None]
    tdist.scatter_object_list(out, [f"to {r}" for r in range(world)] if rank == 0 else None,
                              src=0, group=pg)
    return [got, gathered, lst, out]


def _batch_p2p(pg: Any, rank: int, world: int) -> Any:
    import torch.distributed as tdist

    if world == 1:
        return None  # gloo has no pair to itself
    right, left = (rank + 1) % world, (rank - 1) % world
    send = _val(rank, 0, (2,))
    recv = torch.zeros(2)
    ops = [tdist.P2POp(tdist.isend, send, right, group=pg),
           tdist.P2POp(tdist.irecv, recv, left, group=pg)]
    for w in tdist.batch_isend_irecv(ops):
        w.wait()
    return recv.tolist()


def _sparse_all_reduce(pg: Any, rank: int, world: int) -> Any:
    """Sparse COO sums (gloo's way): index sets differ per rank, overlap, repeat within a
    rank (uncoalesced input), and the values have a dense dimension."""
    import torch.distributed as tdist

    idx = torch.tensor([[rank, 3, rank + 1, 3]])  # row 3 on every rank, twice
    vals = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 10 * rank
    t = torch.sparse_coo_tensor(idx, vals, (6, 2))
    tdist.all_reduce(t, group=pg)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0),
                                    (4,))  # nnz 0 on every rank but the last
    if rank == world - 1:
        empty = torch.sparse_coo_tensor(torch.tensor([[2]]), torch.tensor([5.0]), (4,))
    tdist.all_reduce(empty, group=pg)
    return [t.is_sparse, t.is_coalesced(), t._indices().tolist(), t._values().tolist(),
            empty.to_dense().tolist()]


def _coalescing_manager(pg: Any, rank: int, world: int) -> Any:
    """torch's fast-path coalescing: the recorded ops reach the backend as one
    ``*_coalesced`` call with parallel lists of outputs and inputs."""
    import torch.distributed as tdist

    shapes = [(2,), (1, 3)]
    reduced = [_val(rank, i, s) for i, s in enumerate(shapes)]
    gathered = [torch.zeros((world * s[0],) + s[1:]) for s in shapes]
    scattered = [torch.zeros(s) for s in shapes]
    with tdist._coalescing_manager(group=pg):
        for t in reduced:
            tdist.all_reduce(t, group=pg)
    with tdist._coalescing_manager(group=pg):
        for i, s in enumerate(shapes):
            tdist.all_gather_into_tensor(gathered[i], _val(rank, i, s), group=pg)
    with tdist._coalescing_manager(group=pg):
        for i, s in enumerate(shapes):
            whole = _val(rank, i, (world * s[0],) + s[1:])
            tdist.reduce_scatter_tensor(scattered[i], whole, group=pg)
    return [[t.tolist() for t in ts] for ts in (reduced, gathered, scattered)]


CASES: dict[str, Case] = {
    "sparse_all_reduce": _sparse_all_reduce,
    "coalescing_manager": _coalescing_manager,
    "all_gather_coalesced": _all_gather_coalesced,
    "all_gather_coalesced_same_shape": _all_gather_coalesced_same_shape,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "broadcast_and_reduce": _broadcast_and_reduce,
    "objects": _objects,
    "batch_p2p": _batch_p2p,
}


def _names(world: int) -> dict[str, Any]:
    """A gloo and a rankwise subgroup of the same ranks, side by side: their names as
    torch reads them, and what ``destroy_process_group`` leaves behind."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    got: dict[str, Any] = {}
    for backend in ("gloo", "rankwise"):
        sub = tdist.new_group(list(range(world)), backend=backend)
        name = sub.group_name  # raised "ProcessGroup name not set" on rankwise
        t = torch.ones(1)
        tdist.all_reduce(t, group=sub)
        assert c10d._resolve_process_group(name) is sub
        tdist.destroy_process_group(sub)
        got[backend] = {
            "name_is_torchs": name == c10d._world.pg_names.get(sub, name),
            "name_is_str": isinstance(name, str) and name != "",
            "sum": t.tolist(),
            "still_known": sub in c10d._world.pg_map,
        }
    # the group made after a destroyed one works (a fresh name, a fresh rankwise group)
    again = tdist.new_group(list(range(world)), backend="rankwise")
    t = torch.ones(1)
    tdist.all_reduce(t, group=again)
    got["again"] = t.tolist()
    return got


def _sparse_refusals(pg: Any) -> list[str]:
    """What gloo refuses for sparse tensors, rankwise refuses before any I/O (the group
    still works after)."""
    import torch.distributed as tdist

    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,))
    got = []
    for op in (tdist.ReduceOp.MAX, tdist.ReduceOp.PRODUCT):
        try:
            tdist.all_reduce(sparse, op=op, group=pg)
            got.append("none")
        except ValueError as exc:  # rankwise's InvalidArgument is a ValueError
            got.append(f"{type(exc).__name__}: {'SUM only' in str(exc)}")
    t = torch.ones(1)
    tdist.all_reduce(t, group=pg)
    got.append(str(t.tolist()))
    return got


def _both(rank: int, world: int, gloo_port: int) -> dict[str, Any]:
    """Run every case on a gloo group and on a rankwise group of the same ranks."""
    import torch.distributed as tdist

    import rankwise.torch  # noqa: F401 - registers backend "rankwise"

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                             world_size=world)
    mine = tdist.new_group(backend="rankwise")
    got: dict[str, Any] = {}
    for name, case in CASES.items():
        got[name] = {"gloo": case(None, rank, world), "rankwise": case(mine, rank, world)}
    got["names"] = _names(world)
    got["sparse_refused"] = _sparse_refusals(mine)
    tdist.destroy_process_group()
    return got


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_list_layout_agrees_with_gloo(world: int) -> None:
    per_rank = run_ranks(_both, world, free_port(), backend="rankwise", timeout=180)
    for rank, got in enumerate(per_rank):
        for name in CASES:
            assert got[name]["rankwise"] == got[name]["gloo"], (
                f"{name} on rank {rank} of {world}: rankwise {got[name]['rankwise']} "
                f"vs gloo {got[name]['gloo']}")
    # the defect the issue names, spelled out: rank r's copy of input i at [r][i]
    assert per_rank[0]["all_gather_coalesced_same_shape"]["rankwise"] == [
        [[10.0 * r + i] for i in range(2)] for r in range(world)]

    for got in per_rank:
        assert got["sparse_refused"] == ["InvalidArgument: True"] * 2 + [str([float(world)])]
    # group names (issue 26 item 2): readable, torch's own, and destroy forgets the group
    for got in per_rank:
        assert got["names"]["rankwise"] == got["names"]["gloo"] == {
            "name_is_torchs": True, "name_is_str": True, "sum": [float(world)],
            "still_known": False}
        assert got["names"]["again"] == [float(world)]
