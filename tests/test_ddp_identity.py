"""rankwise's DDP and sampler pass for torch's: isinstance, torch.save, comm hooks, device_ids.

Scripts and libraries unwrap models with ``isinstance(m, DistributedDataParallel)``,
pickle whole DDP models and pass ``device_ids=[rank]``
out of GPU habit; each of those must work on rankwise's classes (issue 14, item 3).
All multi-process scenarios of one backend run in one spawn of 2 ranks.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_ddp import Net, batches, max_diff
from test_ddp_harness import run_ranks
from torch import nn

STEPS = 3
SMALL = {"bucket_cap_mb": 0.0001, "find_unused_parameters": True}  # Net has unused layers


def _train(ddp: Any, rank: int, world: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batches(world, step)[rank]
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def _identity(rank: int, world: int) -> dict[str, Any]:
    """isinstance, device_ids on a CPU model, pickling, torch internals refused."""
    from rankwise.nn import DDPError, DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), device_ids=[0], output_device=0, **SMALL)
    _train(ddp, rank, world)
    results: dict[str, Any] = {
        "isinstance": isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
        "device_ids": ddp.device_ids,
    }
    saved = io.BytesIO()
    torch.save(ddp, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    x, y = batches(world, 0)[rank]
    with torch.no_grad():
        results["loaded_eval_equal"] = bool(torch.equal(loaded(x), ddp.module(x)))
        expected = ddp.module(x)
    results["loaded_eval_mode_equal"] = bool(torch.equal(loaded.eval()(x), expected))
    loaded.train()
    results["loaded_params_equal"] = max_diff(loaded.module, ddp.module) == 0.0
    for name, clone in (("loaded", loaded), ("deepcopy", copy.deepcopy(ddp))):
        try:
            nn.functional.mse_loss(clone(x), y).backward()
        except DDPError as exc:
            results[f"{name}_train_error"] = str(exc)
    try:
        ddp._get_ddp_logging_data()
    except NotImplementedError as exc:
        results["torch_internal"] = str(exc)
    try:
        ddp._distributed_rank  # a property on torch's class  # noqa: B018
    except NotImplementedError as exc:
        results["torch_property"] = str(exc)
    _train(ddp, rank, world)  # the original still trains after being pickled
    return results


@pytest.fixture(scope="module")
def identity() -> list[dict[str, Any]]:
    return run_ranks(_identity, 2, timeout=120)


def test_isinstance_and_cpu_device_ids(identity: list[dict[str, Any]]) -> None:
    assert all(r["isinstance"] and r["device_ids"] is None for r in identity)


def test_torch_save_and_deepcopy(identity: list[dict[str, Any]]) -> None:
    for per_rank in identity:
        assert per_rank["loaded_params_equal"] and per_rank["loaded_eval_equal"]
        assert per_rank["loaded_eval_mode_equal"]
        for name in ("loaded", "deepcopy"):
            assert "Wrap the loaded model's .module" in per_rank[f"{name}_train_error"]


def test_torch_ddp_internals_are_refused(identity: list[dict[str, Any]]) -> None:
    assert "_get_ddp_logging_data" in identity[0]["torch_internal"]
    assert "_distributed_rank" in identity[0]["torch_property"]


def test_sampler_is_torchs() -> None:
    from rankwise.utils.data import DistributedSampler

    sampler = DistributedSampler(range(10), num_replicas=2, rank=1)
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert list(sampler) == list(
        torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=1)
    )
