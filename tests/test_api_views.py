"""``rankwise.all_reduce`` keeps the view (and the checked body per reduce op) of a small
torch tensor it sees again (``api.views``): whatever happens to the tensor between two
calls, the results and the errors must be those of the long way. Ranks as threads over
the in-memory transport: the real API, no sockets.
"""

from __future__ import annotations

from typing import Any

import pytest

import rankwise as rw
from rankwise.errors import InvalidArgument
from rankwise.testing.threads import run_threads

torch = pytest.importorskip("torch")


def test_a_tensor_used_again_and_changed_in_place_reduces_right() -> None:
    def body(rank: int, size: int) -> list[Any]:
        t = torch.full((3,), rank + 1.0)
        out = []
        for _ in range(3):  # seen again: the kept view and body
            t.fill_(rank + 1.0)
            rw.all_reduce(t)
            out.append(t.tolist())
        rw.all_reduce(t, op=rw.ReduceOp.MAX)  # another op: another kept body
        out.append(t.tolist())
        t.fill_(1.0)
        rw.all_reduce(t, op=rw.ReduceOp.premul_sum(rank + 1.0))  # a factor per call
        out.append(t.tolist())
        t.resize_(2)  # same storage, fewer elements: viewed again
        t.fill_(rank + 1.0)
        rw.all_reduce(t)
        out.append(t.tolist())
        t.data = torch.full((2,), rank + 1, dtype=torch.int64)  # same shape, other dtype
        rw.all_reduce(t)
        out.append(t.tolist())
        return out

    for got in run_threads(body, 2):
        assert got == [[3.0] * 3] * 3 + [[3.0] * 3, [3.0] * 3, [3.0] * 2, [3, 3]]


def test_a_kept_tensor_that_turns_bad_is_refused_before_any_io() -> None:
    def body(rank: int, size: int) -> str:
        grid = torch.zeros(2, 2)
        rw.all_reduce(grid)
        grid.as_strided_((2, 2), (1, 2))  # same pointer and shape, no longer contiguous
        with pytest.raises(InvalidArgument, match="not contiguous"):
            rw.all_reduce(grid)
        leaf = torch.zeros(2)
        rw.all_reduce(leaf)
        leaf.requires_grad_()
        with pytest.raises(InvalidArgument, match="requires grad"):
            rw.all_reduce(leaf)
        flag = torch.zeros(2, dtype=torch.bool)
        with pytest.raises(InvalidArgument, match="AVG"):
            rw.all_reduce(flag, op=rw.ReduceOp.AVG)  # refused on first sight and after
        with pytest.raises(InvalidArgument, match="AVG"):
            rw.all_reduce(flag, op=rw.ReduceOp.AVG)
        pre = torch.ones(2)
        rw.all_reduce(pre, op=rw.ReduceOp.premul_sum(2.0))  # a factor: no plan is kept
        with pytest.raises(InvalidArgument, match="needs its factor"):
            rw.all_reduce(pre, op=rw.ReduceOp.PREMUL_SUM)  # bare: refused, seen or not
        rw.barrier()  # the refused calls sent nothing: the ranks still agree
        return "ok"

    assert run_threads(body, 2) == ["ok", "ok"]
