"""DDP on real processes: same result as one process with the whole batch, ranks in step.

Every scenario trains a DDP model on each rank's shard and, on the side, a plain copy
of the same model on the whole batch in the same process (the "one process with batch
N*B" reference, needing no communication). After every step the ranks compare a hash
of their parameters via all_gather_object: they must be bit-identical, and close to
the reference within float tolerance.

All scenarios of one world size run in one spawn of the ranks (process start-up costs
far more than the scenarios themselves); the tests then check the collected numbers.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from test_ddp_harness import core_available, run_ranks
from torch import nn

pytestmark = pytest.mark.procs

FEATURES, OUT, PER_RANK_BATCH, STEPS = 8, 3, 4, 4


class Net(nn.Module):
    """A small MLP with an optional branch and a parameter that is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, OUT))
        self.extra = nn.Linear(FEATURES, OUT)
        self.dead = nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        self.steps += 1
        out = self.body(x)
        return out + self.extra(x) if use_extra else out  # noqa: S610 - not Django


def batches(world: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's shard of step ``step``'s global batch (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * PER_RANK_BATCH, FEATURES, generator=g)
    y = torch.randn(world * PER_RANK_BATCH, OUT, generator=g)
    return list(zip(x.split(PER_RANK_BATCH), y.split(PER_RANK_BATCH), strict=True))


def params_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def uses_extra(rank: int, scenario: dict[str, Any]) -> bool:
    return bool(scenario.get("unused")) and rank == 0


def train(rank: int, world: int, scenario: dict[str, Any]) -> dict[str, Any]:
    """Train DDP and the single-process reference side by side; report the distances."""
    from rankwise.nn import DistributedDataParallel
    from rankwise.nn._comm import comm

    dist = comm()
    torch.manual_seed(rank)  # different initial weights: construction must broadcast rank 0's
    ddp = DistributedDataParallel(Net(), **scenario.get("ddp", {}))
    reference = copy.deepcopy(ddp.module)
    make_opt: Callable[[Any], torch.optim.Optimizer] = scenario.get(
        "opt", lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    opt, ref_opt = make_opt(ddp.parameters()), make_opt(reference.parameters())
    accumulate = scenario.get("accumulate", 1)
    hashes_equal = True
    for step in range(STEPS):
        for micro in range(accumulate):
            shards = batches(world, step * accumulate + micro)
            sync = micro == accumulate - 1
            with nullcontext() if sync else ddp.no_sync():
                x, y = shards[rank]
                out = ddp(x, use_extra=uses_extra(rank, scenario))
                (nn.functional.mse_loss(out, y) / accumulate).backward()
            ref_loss = sum(
                nn.functional.mse_loss(reference(xs, use_extra=uses_extra(r, scenario)), ys)
                for r, (xs, ys) in enumerate(shards)
            )
            (ref_loss / (world * accumulate)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=scenario.get("set_to_none", True))
        ref_opt.zero_grad(set_to_none=scenario.get("set_to_none", True))
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, params_hash(ddp.module))
        hashes_equal &= len(set(everyone)) == 1
    return {
        "diff": max_diff(ddp.module, reference),
        "hashes_equal": hashes_equal,
        "dead_grad_is_none": all(p.grad is None for p in ddp.module.dead.parameters()),
        "state_dict_keys": sorted(ddp.state_dict()),
        "buckets": ddp.statistics().buckets,
    }


SCENARIOS: dict[str, dict[str, Any]] = {
    "sgd": {"ddp": {"find_unused_parameters": True}},
    "tiny_buckets": {"ddp": {"bucket_cap_mb": 0.0001, "find_unused_parameters": True}},
    "no_sync": {"accumulate": 3, "ddp": {"find_unused_parameters": True}},
    "unused": {"unused": True, "ddp": {"find_unused_parameters": True}},
    "bucket_view_adam": {
        "ddp": {"gradient_as_bucket_view": True, "find_unused_parameters": True},
        "opt": lambda ps: torch.optim.Adam(ps, lr=0.01),
        "set_to_none": False,
    },
    "static_graph_momentum": {
        "unused": True,
        "ddp": {"static_graph": True, "bucket_cap_mb": 0.001},
        "opt": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    },
}


def all_scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: train(rank, world, scenario) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request: pytest.FixtureRequest) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(all_scenarios, request.param, timeout=90)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_single_process_with_whole_batch(
    results: list[dict[str, dict[str, Any]]], name: str
) -> None:
    for per_rank in results:
        assert per_rank[name]["diff"] < 1e-5, per_rank[name]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_parameters_bit_identical_across_ranks(
    results: list[dict[str, dict[str, Any]]], name: str
) -> None:
    assert all(per_rank[name]["hashes_equal"] for per_rank in results)


def test_globally_unused_parameter_keeps_no_grad(
    results: list[dict[str, dict[str, Any]]],
) -> None:
    assert all(per_rank["unused"]["dead_grad_is_none"] for per_rank in results)


def test_state_dict_has_module_prefix(results: list[dict[str, dict[str, Any]]]) -> None:
    keys = results[0]["sgd"]["state_dict_keys"]
    assert keys and all(k.startswith("module.") for k in keys)
    assert "module.steps" in keys


def test_small_cap_makes_several_buckets(results: list[dict[str, dict[str, Any]]]) -> None:
    assert results[0]["sgd"]["buckets"] == 1
    assert results[0]["tiny_buckets"]["buckets"] > 2


def _oracle(rank: int, world: int) -> dict[str, Any]:
    return train(rank, world, SCENARIOS["unused"])


@pytest.mark.skipif(not core_available(), reason="rankwise core not importable yet")
def test_oracle_torch_gloo_gives_the_same_parameters() -> None:
    """The same scenario on torch.distributed/gloo: a check on the test itself."""
    values = run_ranks(_oracle, 2, backend="torch", timeout=60)
    assert all(v["diff"] < 1e-5 and v["hashes_equal"] for v in values)
