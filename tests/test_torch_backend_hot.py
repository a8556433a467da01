"""The torch backend's all_reduce hot path (issue 14): remembered tensor views, the reduce
op read by its hash (PREMUL_SUM's factor per call), completed ``Work`` without a torch Future. Each shortcut must give
the same results and the same errors as the long way, whatever happens to a tensor
between two calls."""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_ddp_harness import run_ranks

from rankwise.api.views import MAX_BYTES, TensorViews
from rankwise.errors import InvalidArgument
from rankwise.torch._work import DoneWork

# --- in one process -----------------------------------------------------------------------

def test_a_tensor_seen_again_reuses_its_view() -> None:
    views, t = TensorViews(), torch.ones(3)
    first, memo = views.view(t, "tensor")
    assert memo is not None
    memo["body"] = "kept"
    again, kept = views.view(t, "tensor")
    assert again is first and kept == {"body": "kept"} and len(views) == 1
    first.array[1] = 5.0  # the view is the tensor's memory
    assert t.tolist() == [1.0, 5.0, 1.0]


def test_a_changed_tensor_is_viewed_again() -> None:
    views, t = TensorViews(), torch.ones(4)
    views.view(t, "tensor")
    t.resize_(2)  # same storage and pointer, fewer elements
    buf, memo = views.view(t, "tensor")
    assert buf.numel == 2 and memo == {}  # what was derived from the old view is gone
    t.set_(torch.zeros(6))  # other storage, more elements (numpy made the old one fixed)
    assert views.view(t, "tensor")[0].numel == 6
    views.view(t, "tensor")[0].array[0] = 7.0
    assert t[0].item() == 7.0
    t.data = torch.zeros(6, dtype=torch.int32)  # same shape, other dtype
    assert views.view(t, "tensor")[0].dtype.name == "int32"


def test_a_cached_tensor_that_turns_bad_is_refused() -> None:
    views = TensorViews()
    grid = torch.zeros(2, 2)
    views.view(grid, "tensor")
    grid.as_strided_((2, 2), (1, 2))  # same pointer and shape, no longer contiguous
    with pytest.raises(InvalidArgument, match="not contiguous"):
        views.view(grid, "tensor")
    leaf = torch.zeros(2)
    views.view(leaf, "tensor")
    leaf.requires_grad_()
    with pytest.raises(InvalidArgument, match="requires grad"):
        views.view(leaf, "tensor")


def test_views_leave_with_their_tensors_and_large_ones_are_not_kept() -> None:
    views = TensorViews()
    t = torch.ones(4)
    views.view(t, "tensor")
    assert len(views) == 1 and views.kept == 16
    del t
    gc.collect()
    assert len(views) == 0 and views.kept == 0
    big = torch.ones(MAX_BYTES // 4 + 1)
    assert views.view(big, "tensor")[1] is None  # no memo: nothing kept for its next call
    assert len(views) == 0


def test_kept_views_stay_within_their_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise.api.views as views_module

    monkeypatch.setattr(views_module, "MAX_KEPT", 64)
    views = TensorViews()
    a, b = torch.ones(8), torch.ones(8)  # 32 bytes each: both fit
    assert views.view(a, "tensor")[1] is not None and views.view(b, "tensor")[1] is not None
    c = torch.ones(8)
    assert views.view(c, "tensor")[1] is None and views.kept == 64  # over the budget
    a.set_(torch.ones(4))  # a swapped storage: viewed again, the stale view let go
    assert views.view(a, "tensor")[1] is not None and views.kept == 48
    del b
    gc.collect()
    assert views.kept == 16


def test_done_work_answers_like_a_completed_torch_work() -> None:
    out = [torch.ones(1)]
    work = DoneWork(out)
    assert work.wait() and work.is_completed() and work.is_success()
    assert work.exception() is None and work.result() is out
    fut = work.get_future()
    assert fut.done() and fut.value() is out and work.get_future() is fut


# --- on real processes, through torch.distributed -----------------------------------------

def _hot(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as tdist

    import rankwise.torch  # registers backend "rankwise"

    # rankwise is initialized by the harness; torch's default group reuses its world
    tdist.init_process_group("rankwise", store=tdist.HashStore(), rank=rank, world_size=world)
    got: dict[str, Any] = {}
    t = torch.full((2,), float(rank + 1))
    for _ in range(3):  # the same tensor again and again: its view is remembered
        tdist.all_reduce(t)
    got["sum"] = t.tolist()
    t.fill_(float(rank + 1))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    got["max"] = t.tolist()
    t.set_(torch.full((3,), float(rank)))
    tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
    got["avg_resized"] = t.tolist()
    bits = torch.tensor([rank + 1], dtype=torch.int64)
    tdist.all_reduce(bits, op=tdist.ReduceOp.BXOR)
    got["bxor"] = bits.tolist()
    work = tdist.all_reduce(t, async_op=True)
    assert work is not None
    got["work"] = (work.wait(), work.exception() is None,
                   work.get_future().value()[0] is t, t.tolist())
    # torch 2.14+'s handle of a Python c10d Backend's work (torch's own nccl4py's too)
    # forwards wait and get_future only: is_completed stays False there
    got["completed"] = work.is_completed() or not isinstance(
        tdist.group.WORLD, rankwise.torch.TorchProcessGroup)
    scaled = torch.full((2,), float(rank + 1))
    tdist.all_reduce(scaled, op=tdist._make_nccl_premul_sum(2.0 + rank))  # not cached
    got["premul"] = scaled.tolist()
    # a resized tensor must carry its new element count: rank 1 shrinks it in place (same
    # pointer), the ranks disagree, and both must be told (the count of the fresh view)
    count = torch.ones(2)
    tdist.all_reduce(count)
    if rank == 1:
        count.resize_(1)
    try:
        tdist.all_reduce(count)
        got["mismatch"] = "none"
    except Exception as exc:  # noqa: BLE001 - the test checks the class
        got["mismatch"] = type(exc).__name__
    return got


@pytest.mark.procs
def test_hot_path_gives_torchs_results(engine: str) -> None:
    """On each engine (``engine`` fixture: the ranks inherit ``RANKWISE_ENGINE``)."""
    per_rank = run_ranks(_hot, 2, backend="rankwise", timeout=180)
    for got in per_rank:
        assert got["sum"] == [12.0, 12.0]  # 1 + 2, doubled twice
        assert got["max"] == [2.0, 2.0]
        assert got["avg_resized"] == [0.5, 0.5, 0.5]
        assert got["bxor"] == [3]
        assert got["work"] == (True, True, True, [1.0, 1.0, 1.0])
        assert got["completed"]
        assert got["premul"] == [8.0, 8.0]  # 1 * 2.0 + 2 * 3.0: each rank's own factor
        assert got["mismatch"] == "CollectiveMismatch", got


def test_a_wait_that_meets_the_worker_settling_returns_with_the_future_complete(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's callback and ``wait`` may both settle the torch future: the one that
    comes second must not return before the first has completed it (``wait();
    get_future().value()`` raised torch's "completed() INTERNAL ASSERT FAILED")."""
    import threading

    from rankwise.core.work import Work
    from rankwise.torch._work import AsyncWork

    entered, release = threading.Event(), threading.Event()
    complete = AsyncWork._complete

    def slow_complete(self: AsyncWork, error: BaseException | None) -> None:
        entered.set()
        assert release.wait(10)
        complete(self, error)

    monkeypatch.setattr(AsyncWork, "_complete", slow_complete)
    out = [torch.ones(1)]
    inner = Work("all_reduce #1 on test", out)
    work = AsyncWork(inner, out)
    worker = threading.Thread(target=inner._finish)  # the async worker ending the call
    worker.start()
    assert entered.wait(10)  # it is completing the torch future now
    seen: list[bool] = []

    def wait() -> None:
        work.wait()
        seen.append(work.get_future().done())

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(0.5)  # it must still be waiting for the worker (a bound, not a sync)
    release.set()
    waiter.join(10)
    worker.join(10)
    assert seen == [True]
