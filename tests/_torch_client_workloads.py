"""Real torch workloads, each run on a gloo group and on a rankwise group of the same ranks
(``test_torch_clients``): small models, fixed seeds, the final parameters returned so the
parent can compare them bit for bit. One job runs them all (one spawn of the ranks).

Each workload takes ``(pg, rank, world, tmp)``: ``pg`` the torch group to use, ``tmp`` a
folder private to that group's run. Whatever it returns is compared between backends;
a workload that raises gives ``"raised: ..."`` on that backend, which then differs.
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

Workload = Callable[[Any, int, int, Path], Any]


def _params(model: nn.Module) -> dict[str, list[float]]:
    """Full (unsharded) parameters as lists: what the parent compares."""
    out: dict[str, list[float]] = {}
    for name, p in model.state_dict().items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().reshape(-1).tolist()
    return out


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(model: nn.Module, rank: int, steps: int = 3) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


# --- the regressions of issue 35 -----------------------------------------------------------

def storage_stays_resizable(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """FSDP1's free: a gathered tensor's storage is resized to 0 and back."""
    out = torch.zeros(2 * world)
    tdist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=pg)
    gathered = out.tolist()
    out.untyped_storage().resize_(0)
    out.untyped_storage().resize_(out.numel() * out.element_size())
    small = torch.ones(3)
    tdist.all_reduce(small, group=pg)  # the hot path's remembered view, too
    small.untyped_storage().resize_(0)
    return gathered


def leaf_receives(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """irecv and broadcast into a leaf that requires grad (pipelining's buffers)."""
    got = torch.zeros(3, requires_grad=True)
    if rank == 0:
        tdist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1, group=pg)
    else:
        tdist.irecv(got, src=0, group=pg).wait()
    cast = torch.full((2,), float(rank + 5), requires_grad=True)
    tdist.broadcast(cast, src=0, group=pg)
    return {"recv": got.tolist(), "broadcast": cast.tolist(), "leaf": got.is_leaf}


def premul_sum(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """PREMUL_SUM (rankwise only: gloo refuses it, so the parent checks the value)."""
    if tdist.get_backend(pg) == "gloo":
        return None
    t = torch.full((3,), float(rank + 1))
    tdist.all_reduce(t, op=tdist._make_nccl_premul_sum(0.5), group=pg)  # type: ignore[attr-defined]
    return t.tolist()


def batch_p2p(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """``batch_isend_irecv``: torch 2.14 asks the group for its C++ backend first."""
    peer = (rank + 1) % world
    got = torch.zeros(2)
    ops = [tdist.P2POp(tdist.isend, torch.full((2,), float(rank)), group=pg, group_peer=peer),
           tdist.P2POp(tdist.irecv, got, group=pg, group_peer=(rank - 1) % world)]
    for work in tdist.batch_isend_irecv(ops):
        work.wait()
    return got.tolist()


# --- torch's clients ----------------------------------------------------------------------

def fsdp1(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_mlp(), process_group=pg, use_orig_params=True, device_id=torch.device("cpu"))
    _train(model, rank)
    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.reshape(-1).tolist() for k, v in model.state_dict().items()}


def _mesh(pg: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(pg, "cpu")


def fsdp2(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    mesh = _mesh(pg)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank)
    return _params(model)


def tensor_parallel(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = parallelize_module(_mlp(), _mesh(pg), {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
    _train(model, 0)  # tensor parallel: every rank sees the same batch
    return _params(model)


def checkpoint(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """Distributed checkpoint of an FSDP2 model: saved, then loaded into a fresh one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(pg)
    model = fully_shard(_mlp(), mesh=mesh)
    _train(model, rank, steps=1)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp / "ckpt"), process_group=pg)
    fresh = fully_shard(_mlp(seed=1), mesh=mesh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp / "ckpt"), process_group=pg)
    fresh.load_state_dict(state["model"])
    return _params(fresh) == _params(model), _params(fresh)


def load_resharded(rank: int, world: int, gloo_port: int, root: str) -> dict[str, Any]:
    """Each backend's 2-rank checkpoint (``checkpoint``) loaded on ``world`` ranks over
    rankwise: {saver: full parameters}. (gloo loads them in ``checkpoint`` at 2 ranks.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import rankwise.torch  # noqa: F401 - registers backend "rankwise"

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                             world_size=world)  # torch's default group; unused below
    mine = tdist.new_group(backend="rankwise", timeout=timedelta(seconds=30))
    got = {}
    for saver in ("gloo", "rankwise"):
        model = fully_shard(_mlp(seed=1), mesh=_mesh(mine))
        state = {"model": model.state_dict()}
        path = Path(root) / saver / "checkpoint" / "ckpt"
        dcp.load(state, checkpoint_id=str(path), process_group=mine)
        model.load_state_dict(state["model"])
        got[saver] = _params(model)
    return got


def _pipeline(schedule_name: str) -> Workload:
    def run(pg: Any, rank: int, world: int, tmp: Path) -> Any:
        from torch.distributed import pipelining

        full = _mlp()
        part = full[:2] if rank == 0 else full[2:]
        stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"), group=pg)
        cls = getattr(pipelining, schedule_name)
        schedule = cls(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(part.parameters(), lr=0.1)
        for step in range(2):
            pipeline_step(schedule, opt, rank, step)
        return _params(part)
    run.__name__ = f"pipeline_{schedule_name}"
    return run


def pipeline_step(schedule: Any, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One training step of the two-stage pipeline (also ``benchmarks/torch_programs``')."""
    x, y = _batch(0, step)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    opt.step()
    opt.zero_grad()


def ddp_hooks(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """DDP with a comm hook, no_sync accumulation and Join over uneven inputs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(), process_group=pg)
    model.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(rank, 0)
    with model.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    with Join([model]):
        for step in range(2 + rank):  # uneven: rank 1 takes one step more
            x, y = _batch(rank, step + 1)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return _params(model.module)


def ddp_overlap(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """A DDP comm hook returns before its bucket's reduction ends, and what is chained on
    the future runs off the backward thread (rank 1 comes 0.5 s late, so on rank 0 the
    reduction cannot end before then)."""
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    seen: dict[str, Any] = {}

    def hook(state, bucket):  # type: ignore[no-untyped-def] - torch reads the annotations
        backward = threading.get_ident()
        fut = tdist.all_reduce(bucket.buffer(), group=pg, async_op=True).get_future()

        def done(f: Any) -> Any:
            seen["done_at"] = time.monotonic()
            seen["other_thread"] = threading.get_ident() != backward
            return f.value()[0]

        chained = fut.then(done)
        seen["returned_at"] = time.monotonic()
        return chained

    model = DDP(_mlp(), process_group=pg, bucket_cap_mb=1000)  # one bucket
    model.register_comm_hook(None, hook)
    x, y = _batch(rank, 0)
    loss = nn.functional.mse_loss(model(x), y)
    if rank == 1:
        time.sleep(0.5)  # lateness is the point, not synchronization
    loss.backward()
    if rank == 1:
        return None
    return {"hook_returned_first": seen["returned_at"] < seen["done_at"],
            "callback_off_the_backward_thread": seen["other_thread"]}


def barrier_timeout(pg: Any, rank: int, world: int, tmp: Path) -> Any:
    """``barrier(timeout=1s)`` with the peer 4 s late: rank 0 raises (last: it may leave
    the group unusable)."""
    if rank == 0:
        start = time.monotonic()
        try:
            if "timeout" in inspect.signature(tdist.barrier).parameters:
                tdist.barrier(group=pg, timeout=timedelta(seconds=1))
            else:  # torch 2.11's barrier() has no timeout=: the options it would fill
                opts = tdist.BarrierOptions()
                opts.timeout = timedelta(seconds=1)
                pg.barrier(opts).wait()
        except Exception as exc:  # noqa: BLE001 - what was raised is the result
            return {"raised_after": time.monotonic() - start, "message": str(exc)}
        return {"raised_after": None, "returned_after": time.monotonic() - start}
    time.sleep(4.0)  # the late peer: lateness is the point, not synchronization
    return None


#: the workloads, in the order they run (``barrier_timeout`` last, see there)
WORKLOADS: dict[str, Workload] = {w.__name__: w for w in (
    storage_stays_resizable, leaf_receives, premul_sum, batch_p2p, fsdp1, fsdp2, tensor_parallel,
    checkpoint, _pipeline("ScheduleGPipe"), _pipeline("Schedule1F1B"), ddp_hooks,
    ddp_overlap)}


def run_all(rank: int, world: int, gloo_port: int, root: str) -> dict[str, Any]:
    """Every workload on a gloo default group and on a rankwise group of the same ranks
    (rankwise's world is already up: ``test_ddp_harness``)."""
    import rankwise.torch  # noqa: F401 - registers backend "rankwise"

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                             world_size=world)
    # a short timeout: a regression fails its workload in seconds instead of hanging
    mine = tdist.new_group(backend="rankwise", timeout=timedelta(seconds=30))
    groups = {"gloo": tdist.group.WORLD, "rankwise": mine}
    got: dict[str, Any] = {}
    for name, work in WORKLOADS.items():
        got[name] = {}
        for backend, pg in groups.items():
            tmp = Path(root) / backend / name
            tmp.mkdir(parents=True, exist_ok=True)
            start = time.monotonic()
            try:
                got[name][backend] = work(pg, rank, world, tmp)
            except Exception as exc:  # noqa: BLE001 - reported per workload, not per job
                got[name][backend] = f"raised: {exc!r}\n{traceback.format_exc()[-3000:]}"
            got[name][f"{backend}_s"] = time.monotonic() - start
    got["barrier_timeout"] = {"rankwise": barrier_timeout(groups["rankwise"], rank, world,
                                                          Path(root))}
    return got
