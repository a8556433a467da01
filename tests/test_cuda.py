"""Issue 13 on GPUs: NCCL and CUDA tensors under rankwise's checks.

Run on a machine with a CUDA GPU and torch built with CUDA:

    python -m pytest -q -m cuda tests/

(skipped elsewhere, see conftest). What exists today: the backend names are parsed, and
without CUDA ``init_process_group("nccl")`` fails before any I/O (test_errors_local).
The NCCL data plane and CUDA tensors on the torch engines are not built yet: these tests
state the acceptance and are marked ``xfail(strict=True, raises=InvalidArgument)``, so
on a GPU they pass only while rankwise refuses with its clear error, and fail (strict)
the day the feature works, telling whoever built it to drop the mark.
"""

from __future__ import annotations

from typing import Any

import pytest

from rankwise.errors import InvalidArgument
from rankwise.testing import run_ranks

NOT_BUILT = pytest.mark.xfail(strict=True, raises=InvalidArgument,
                              reason="issue 13: the NCCL / CUDA data plane is not built yet")
pytestmark = [pytest.mark.cuda, pytest.mark.torch, pytest.mark.timeout(300), NOT_BUILT]


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


def _raise_first(results: list[Any]) -> None:
    """Every rank ok, else raise the first rank's own exception type where it is
    rankwise's refusal (what the xfail mark expects today)."""
    for res in results:
        if res.error_type == "InvalidArgument":
            raise InvalidArgument(f"rank {res.rank}: {res.message}")
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_world_size_one(backend: str) -> None:
    results = run_ranks(_sum_on_gpu, 1, init_kwargs={"backend": backend}, timeout=240)
    _raise_first(results)
    assert results[0].value == [2.0] * 4  # 1 + 1: two all_reduces of one rank


def test_two_processes_on_nccl() -> None:
    """One GPU per rank (NCCL refuses two ranks of one communicator on one GPU)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: this machine has one")
    results = run_ranks(_sum_on_gpu, 2, init_kwargs={"backend": "nccl"}, timeout=240)
    _raise_first(results)
    assert all(r.value == [6.0] * 4 for r in results)  # (1 + 2) * 2


def test_two_processes_share_one_gpu_on_torch_gloo() -> None:
    """CUDA tensors on torch-gloo, both ranks on GPU 0 (gloo stages through the host)."""
    results = run_ranks(_sum_on_gpu, 2, args=(True,), init_kwargs={"backend": "torch-gloo"},
                        timeout=240)
    _raise_first(results)
    assert all(r.value == [6.0] * 4 for r in results)
