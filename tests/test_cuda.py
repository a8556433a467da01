"""Issue 13 on GPUs: NCCL and CUDA tensors under rankwise's checks.

Run on a machine with a CUDA GPU and torch built with CUDA:

    python -m pytest -q -m cuda tests/

(skipped elsewhere, see conftest). Without a GPU the same code paths run in
``test_tensor_path.py`` and the differential suite (``RANKWISE_TENSOR_PATH``: torch
tensors through the NCCL engine's class on gloo, and staged through host memory); this
file is what only a GPU can show. Not run yet on a GPU: no GPU machine was at hand when
the data plane was built.
"""

from __future__ import annotations

from typing import Any

import pytest

from rankwise.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.torch, pytest.mark.procs, pytest.mark.timeout(300)]


def _sum_on_gpu(rank: int, world: int, share: bool = False) -> list[float]:
    import torch

    import rankwise as dist

    device = torch.device("cuda", 0 if share else rank % torch.cuda.device_count())
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    return t.cpu().tolist()


def _all_ok(results: list[Any]) -> None:
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_world_size_one(backend: str) -> None:
    results = run_ranks(_sum_on_gpu, 1, init_kwargs={"backend": backend}, timeout=240)
    _all_ok(results)
    assert results[0].value == [1.0] * 4  # one rank: a SUM over one rank leaves 1.0 as is


def test_two_processes_on_nccl() -> None:
    """One GPU per rank (NCCL refuses two ranks of one communicator on one GPU)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: this machine has one")
    results = run_ranks(_sum_on_gpu, 2, init_kwargs={"backend": "nccl"}, timeout=240)
    _all_ok(results)
    assert all(r.value == [6.0] * 4 for r in results)  # (1 + 2) * 2


@pytest.mark.parametrize("backend", ["gloo", "torch-gloo"])
def test_two_processes_share_one_gpu_staged(backend: str) -> None:
    """CUDA tensors on rankwise's own engine and on torch-gloo: staged through the host."""
    results = run_ranks(_sum_on_gpu, 2, args=(True,), init_kwargs={"backend": backend},
                        timeout=240)
    _all_ok(results)
    assert all(r.value == [6.0] * 4 for r in results)


def _collectives_on_gpu(rank: int, world: int) -> dict[str, Any]:
    """Every op kind once on CUDA tensors, results read back on the host."""
    import torch

    import rankwise as dist

    dev = torch.device("cuda", 0)
    out: dict[str, Any] = {"engine": dist.group.WORLD.engine_name()}
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.tolist()
    g = [torch.zeros(2, device=dev) for _ in range(world)]
    dist.all_gather(g, torch.full((2,), float(rank), device=dev))
    out["gather"] = [x.tolist() for x in g]
    b = torch.full((2,), float(rank), device=dev, dtype=torch.bfloat16)
    dist.broadcast(b, src=0)
    out["bcast"] = b.float().tolist()
    c = torch.ones(2)  # a CPU tensor on the same "nccl" group: the CPU engine moves it
    dist.all_reduce(c)
    out["cpu"] = c.tolist()
    return out


def test_world_size_one_every_op_kind_on_nccl() -> None:
    results = run_ranks(_collectives_on_gpu, 1, init_kwargs={"backend": "nccl"}, timeout=240)
    _all_ok(results)
    v = results[0].value
    assert "nccl" in v["engine"] and v["max"] == [1.0] * 3 and v["bcast"] == [0.0, 0.0] \
        and v["cpu"] == [1.0, 1.0]


def _ddp_on_gpu(rank: int, world: int) -> list[list[float]]:
    import torch

    from rankwise.nn import DistributedDataParallel as DDP

    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(4, 2).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4, device="cuda")).sum().backward()
        opt.step()
    return [p.detach().cpu().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_ddp_with_a_cuda_model(backend: str) -> None:
    """A CUDA module under rankwise's DDP: buckets on the GPU; replicas identical (NCCL
    needs a GPU per rank: one rank there on a one-GPU machine)."""
    import torch

    world = 2 if backend == "gloo" or torch.cuda.device_count() >= 2 else 1
    results = run_ranks(_ddp_on_gpu, world, init_kwargs={"backend": backend}, timeout=240)
    _all_ok(results)
    assert all(r.value == results[0].value for r in results)


def _async_on_a_side_stream(rank: int, world: int) -> dict[str, Any]:
    """Issue 28: an async collective issued on a user stream is ordered after that
    stream's work (it runs on rankwise's side stream, which follows the caller's), and
    ``wait``/``get_future``/``is_completed`` behave as torch's."""
    import torch

    import rankwise as dist

    user = torch.cuda.Stream()
    out = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(user):
        t = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(int(2e8))  # a race with the collective would read t before x3
        t.mul_(3)
        work = dist.all_gather_into_tensor(out, t, async_op=True)
        assert work is not None
        fut = work.get_future()
        work.wait()  # the user stream waits for the collective; the host does not
        total = out.sum().item()
    fut.wait()
    return {"total": total, "completed": work.is_completed(), "future": fut.done()}


def test_async_collective_follows_the_callers_stream() -> None:
    results = run_ranks(_async_on_a_side_stream, 1, init_kwargs={"backend": "nccl"},
                        timeout=240)
    _all_ok(results)
    v = results[0].value
    assert v == {"total": 3.0 * (1 << 20), "completed": True, "future": True}, v
