"""Misuse of DDP gives a clear error on every affected rank, and nobody hangs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_ddp_harness import core_available, run_ranks
from torch import nn


def _mismatch(rank: int, world: int) -> str:
    from rankwise.nn import DistributedDataParallel, ParameterMismatch

    width = 5 if rank == 0 else 6
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width))
    with pytest.raises(ParameterMismatch) as caught:
        DistributedDataParallel(model)
    return str(caught.value)


@pytest.mark.procs
def test_parameter_mismatch_raises_on_every_rank() -> None:
    messages = run_ranks(_mismatch, 2, timeout=60)
    assert messages[0] == messages[1]
    assert "'1.weight' shape [5, 4]" in messages[0]
    assert "rank 0" in messages[0] and "rank 1" in messages[0]


class OneIdle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.idle = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _misuse(rank: int, world: int) -> dict[str, Any]:
    """Errors that need a group; the group must stay usable after each of them."""
    from rankwise.errors import InvalidArgument
    from rankwise.nn import DDPError, DistributedDataParallel
    from rankwise.nn._comm import comm
    from rankwise.utils.data import DistributedSampler

    seen: dict[str, Any] = {}
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(InvalidArgument) as no_grad:
        DistributedDataParallel(frozen)
    seen["no_grad"] = str(no_grad.value)

    ddp = DistributedDataParallel(OneIdle())
    with pytest.raises(DDPError) as unused:
        ddp(torch.ones(2, 3)).sum().backward()
    seen["unused"] = str(unused.value)

    everyone: list[Any] = [None] * world
    comm().all_gather_object(everyone, rank)  # still in step after the error
    seen["group_still_works"] = everyone == list(range(world))
    sampler = DistributedSampler(range(10), shuffle=False)
    seen["sampler"] = (sampler.num_replicas, sampler.rank, list(sampler))
    return seen


@pytest.mark.procs
def test_misuse_errors_are_clear_and_do_not_desync() -> None:
    results = run_ranks(_misuse, 2, timeout=60)
    for rank, seen in enumerate(results):
        assert "doesn't have any parameter that requires a gradient" in seen["no_grad"]
        assert "'idle.weight'" in seen["unused"]
        assert "find_unused_parameters=True" in seen["unused"]
        assert seen["group_still_works"]
        assert seen["sampler"] == (2, rank, list(range(rank, 10, 2)))


@pytest.mark.skipif(not core_available(), reason="rankwise core not importable yet")
def test_sampler_without_group_or_rank_says_what_to_do() -> None:
    from rankwise.errors import InvalidArgument
    from rankwise.utils.data import DistributedSampler

    with pytest.raises(InvalidArgument, match="init_process_group"):
        DistributedSampler(range(4))
    with pytest.raises(ValueError, match="Invalid rank 2"):
        DistributedSampler(range(4), num_replicas=2, rank=2)


def test_non_cpu_devices_rejected_before_any_communication() -> None:
    from rankwise.errors import InvalidArgument
    from rankwise.nn import DistributedDataParallel

    with pytest.raises(InvalidArgument, match="on the CPU or on one CUDA device.*meta"):
        DistributedDataParallel(nn.Linear(2, 2, device="meta"))
