"""rankwise's DDP and sampler pass for torch's: isinstance, torch.save, comm hooks, device_ids.

Scripts and libraries unwrap models with ``isinstance(m, DistributedDataParallel)``,
pickle whole DDP models, register communication hooks and pass ``device_ids=[rank]``
out of GPU habit; each of those must work on rankwise's classes (issue 14, item 3).
All multi-process scenarios of one backend run in one spawn of 2 ranks.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_ddp import Net, batches, max_diff, params_hash
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


def _rankwise_allreduce_hook(state: Any, bucket: Any) -> Any:
    """The user-written equivalent of torch's allreduce_hook, on rankwise's own API."""
    from rankwise.nn._comm import comm

    dist = comm()
    state["calls"].append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
    world = dist.get_world_size()
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0] / world)


def _hooked(rank: int, world: int) -> dict[str, Any]:
    """Default reduction vs. a comm hook (small buckets so there are several)."""
    from rankwise.nn import DDPError, DistributedDataParallel
    from rankwise.nn._comm import comm

    results: dict[str, Any] = {}
    torch.manual_seed(0)
    plain = DistributedDataParallel(Net(), **SMALL)
    hooked = DistributedDataParallel(copy.deepcopy(plain.module), **SMALL)
    state: dict[str, Any] = {"calls": []}
    hooked.register_comm_hook(state, _rankwise_allreduce_hook)
    try:
        hooked.register_comm_hook(state, _rankwise_allreduce_hook)
    except DDPError as exc:
        results["twice"] = str(exc)
    _train(plain, rank, world)
    _train(hooked, rank, world)
    everyone: list[Any] = [None] * world
    comm().all_gather_object(everyone, params_hash(hooked.module))
    results.update(
        diff=max_diff(plain.module, hooked.module),
        hashes_equal=len(set(everyone)) == 1,
        calls=state["calls"],
        buckets=hooked.statistics().buckets,
    )
    try:
        plain.register_comm_hook(None, _rankwise_allreduce_hook)
    except DDPError as exc:
        results["after_backward"] = str(exc)
    return results


def _torch_hook(rank: int, world: int) -> dict[str, Any]:
    """torch's own allreduce_hook on rankwise's DDP. The hook calls torch.distributed on
    its WORLD group, which ``import rankwise.torch`` makes a view of rankwise's world, so
    every byte still goes through rankwise."""
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import rankwise.torch  # noqa: F401 - registers backend "rankwise"
    from rankwise.nn import DistributedDataParallel

    # rankwise is initialized already (the harness, which also tears it down): torch's
    # default group reuses that world
    tdist.init_process_group("rankwise", store=tdist.HashStore(), rank=rank, world_size=world)
    torch.manual_seed(0)
    plain = DistributedDataParallel(Net(), **SMALL)
    hooked = DistributedDataParallel(copy.deepcopy(plain.module), **SMALL)
    buckets: list[int] = []

    def counted(state: Any, bucket: Any) -> Any:
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    hooked.register_comm_hook(None, counted)
    _train(plain, rank, world)
    _train(hooked, rank, world)
    return {"diff": max_diff(plain.module, hooked.module), "backend": tdist.get_backend(),
            "hook_calls": len(buckets), "buckets": hooked.statistics().buckets}


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
def hooked() -> list[dict[str, Any]]:
    return run_ranks(_hooked, 2, timeout=120)


@pytest.fixture(scope="module")
def identity() -> list[dict[str, Any]]:
    return run_ranks(_identity, 2, timeout=120)


@pytest.mark.procs
def test_comm_hook_gives_the_default_reduction(hooked: list[dict[str, Any]]) -> None:
    for per_rank in hooked:
        assert per_rank["diff"] < 1e-6, per_rank
        assert per_rank["hashes_equal"]


@pytest.mark.procs
def test_comm_hook_sees_every_bucket_in_order(hooked: list[dict[str, Any]]) -> None:
    calls, buckets = hooked[0]["calls"], hooked[0]["buckets"]
    assert buckets > 2
    assert [index for index, _, _ in calls] == list(range(buckets)) * STEPS
    assert [last for _, last, _ in calls] == [i == buckets - 1 for i in range(buckets)] * STEPS
    assert sum(n for _, _, n in calls[:buckets]) == len(list(Net().parameters()))


@pytest.mark.procs
def test_comm_hook_registration_rules(hooked: list[dict[str, Any]]) -> None:
    assert "only be called once" in hooked[0]["twice"]
    assert "before the first backward" in hooked[0]["after_backward"]


@pytest.mark.procs
def test_torch_allreduce_hook_works() -> None:
    for per_rank in run_ranks(_torch_hook, 2, backend="rankwise", timeout=120):
        assert per_rank["diff"] < 1e-6, per_rank
        assert per_rank["backend"] == "rankwise"
        assert per_rank["hook_calls"] == per_rank["buckets"] * STEPS > 0


@pytest.mark.procs
def test_isinstance_and_cpu_device_ids(identity: list[dict[str, Any]]) -> None:
    assert all(r["isinstance"] and r["device_ids"] is None for r in identity)


@pytest.mark.procs
def test_torch_save_and_deepcopy(identity: list[dict[str, Any]]) -> None:
    for per_rank in identity:
        assert per_rank["loaded_params_equal"] and per_rank["loaded_eval_equal"]
        assert per_rank["loaded_eval_mode_equal"]
        for name in ("loaded", "deepcopy"):
            assert "Wrap the loaded model's .module" in per_rank[f"{name}_train_error"]


@pytest.mark.procs
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


def test_bad_hook_is_refused_before_any_collective() -> None:
    from rankwise.errors import InvalidArgument
    from rankwise.nn._comm_hook import check_hook

    with pytest.raises(InvalidArgument, match="callable"):
        check_hook(42)
    with pytest.raises(InvalidArgument, match=r"\(state, bucket\)"):
        check_hook(lambda bucket: bucket)
