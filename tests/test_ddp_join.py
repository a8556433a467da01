"""Uneven inputs: ``ddp.join()`` lets ranks stop at different steps without hanging."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_ddp import Net, batches, max_diff, params_hash
from test_ddp_harness import run_ranks
from torch import nn

pytestmark = pytest.mark.procs

BATCHES_OF = {0: 5, 1: 2}


def _uneven(rank: int, world: int) -> dict[str, Any]:
    from rankwise.nn import DDPError, DistributedDataParallel
    from rankwise.nn._comm import comm

    ddp = DistributedDataParallel(Net(), find_unused_parameters=True)
    reference = copy.deepcopy(ddp.module)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with ddp.join():
        for step in range(BATCHES_OF[rank]):
            x, y = batches(world, step)[rank]
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    # Reference: a joined rank contributes zero gradient, the sum is divided by the
    # initial world size (torch's divide_by_initial_world_size=True).
    for step in range(max(BATCHES_OF.values())):
        shards = batches(world, step)
        active = [r for r in range(world) if step < BATCHES_OF[r]]
        loss = sum(nn.functional.mse_loss(reference(*shards[r][:1]), shards[r][1]) for r in active)
        (loss / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    everyone: list[Any] = [None] * world
    comm().all_gather_object(everyone, params_hash(ddp.module))

    raised = ""
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(BATCHES_OF[rank]):
                x, y = batches(world, step)[rank]
                nn.functional.mse_loss(ddp(x), y).backward()
    except DDPError as exc:
        raised = str(exc)
    return {
        "diff": max_diff(ddp.module, reference),
        "same": len(set(everyone)) == 1,
        "raised": raised,
    }


@pytest.fixture(scope="module")
def uneven() -> list[dict[str, Any]]:
    return run_ranks(_uneven, 2, timeout=60)


def test_join_keeps_ranks_in_step_and_matches_reference(uneven: list[dict[str, Any]]) -> None:
    for result in uneven:
        assert result["same"]
        assert result["diff"] < 1e-5


def test_throw_on_early_termination_raises_on_every_rank(uneven: list[dict[str, Any]]) -> None:
    for result in uneven:
        assert "ran out of inputs" in result["raised"]
