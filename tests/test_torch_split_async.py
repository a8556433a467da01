"""An async all_reduce on torch's gloo runs split (``engines.torch.host_async``): enqueued on
the caller's thread, completed by gloo's, no hop to rankwise's async worker. It must give
gloo's results (a dtype gloo lacks included: its write-back runs before the call is
done), complete torch's future for DDP, and stay bounded: a peer that never joins ends
the call at rankwise's deadline, naming it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _procs import run_ranks

pytestmark = [pytest.mark.procs, pytest.mark.torch]


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _split_calls(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as tdist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import rankwise
    import rankwise.torch  # registers backend "rankwise" (rankwise.all_reduce below)

    tdist.init_process_group("rankwise", store=tdist.HashStore(), rank=rank, world_size=world)
    got: dict[str, Any] = {}
    # torch's API: DDP's bucket (the reducer's async all_reduce) and async_op=True
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2))
    model(torch.full((3, 4), float(rank + 1))).sum().backward()
    got["grad"] = model.module.weight.grad.tolist()
    t = torch.full((3,), float(rank + 1))
    work = tdist.all_reduce(t, async_op=True)
    assert work is not None
    got["torch_async"] = (work.wait(), work.get_future().value()[0].tolist())
    # rankwise's API, and a dtype gloo lacks (int16: reduced widened, written back)
    narrow = torch.full((4,), 20000 + rank, dtype=torch.int16)
    w = rankwise.all_reduce(narrow, async_op=True)
    assert w is not None
    fut = w.get_future()
    w.wait()
    got["int16"] = (narrow.tolist(), w.is_completed(), fut.wait()[0] is narrow)
    got["threads"] = sorted(n for n in _threads() if n.startswith("rankwise-async"))
    return got


def test_async_all_reduce_on_gloo_runs_split_with_gloos_results() -> None:
    per_rank = run_ranks(_split_calls, 2, init_kwargs={"backend": "torch-gloo"},
                         timeout=120)
    failed = [r.traceback for r in per_rank if r.error_type is not None]
    assert not failed, failed
    for r in per_rank:
        got = r.value
        # d(sum of outputs)/dW summed over ranks: rank r's inputs are all r + 1
        assert got["grad"] == [[4.5, 4.5, 4.5, 4.5]] * 2, got  # (3*1 + 3*2) / 2 ranks
        assert got["torch_async"] == (True, [3.0, 3.0, 3.0])
        # 20000 + 20001 wraps in int16 exactly as a narrow sum would
        wrapped = (40001 + 2**15) % 2**16 - 2**15
        assert got["int16"] == ([wrapped] * 4, True, True), got
        assert got["threads"] == [], "the split calls started rankwise's async worker"


def _peer_never_joins(rank: int, world: int, fifo: str) -> str:
    import time

    import torch.distributed as tdist

    import rankwise.torch  # noqa: F401 - registers backend "rankwise"

    tdist.init_process_group("rankwise", store=tdist.HashStore(), rank=rank, world_size=world)
    if rank == 1:  # busy for longer than the group's timeout: it never calls
        with open(fifo, "rb") as done:  # opens once rank 0 opens it to write
            return f"waited {done.read()!r}"
    started = time.monotonic()
    try:
        work = tdist.all_reduce(torch.ones(2), async_op=True)
        assert work is not None
        work.get_future().wait()  # what DDP's reducer waits on: unbounded in torch
        outcome = "completed"
    except Exception as exc:  # noqa: BLE001 - the test reads what it says
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        with open(fifo, "wb") as done:  # rank 1 may go now
            done.write(b"rank 0 is done")
    return f"{time.monotonic() - started:.1f}s {outcome}"


def test_a_split_call_whose_peer_never_joins_ends_at_the_deadline(tmp_path: Any) -> None:
    import os

    fifo = tmp_path / "done"
    os.mkfifo(fifo)
    per_rank = run_ranks(_peer_never_joins, 2, args=(str(fifo),),
                         init_kwargs={"backend": "torch-gloo", "timeout": 3.0}, timeout=90)
    rank0 = per_rank[0]
    text = rank0.value if rank0.error_type is None else rank0.traceback
    seconds = float(text.split("s ", 1)[0]) if rank0.error_type is None else -1.0
    assert "completed" not in text, text
    assert "all_reduce" in text and ("timeout" in text.lower() or "timed out" in text), text
    assert 2.5 <= seconds <= 30, text  # the group's 3 s, not gloo's own (33 s)
