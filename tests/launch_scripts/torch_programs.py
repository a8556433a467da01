"""Third-party-style programs for ``tests/test_torch_backend.py``: written only against
``torch.distributed`` (plus ``import rankwise.torch``), run under ``rankwise run``.

``python torch_programs.py CASE BACKEND [OUTDIR]``. Lines the tests assert on carry an
``# @marker`` comment (found with ``test_diagnosis_programs.line_of``).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

import rankwise.torch  # noqa: F401 - registers backend "rankwise"
from rankwise.torch import SyncBatchNorm, convert_sync_batchnorm


def sbn_check(rank: int, out: Path, backend: str) -> None:
    """SyncBatchNorm over the ranks' batches == BatchNorm over their concatenation: output,
    input gradient and running stats (each rank weighs its outputs differently)."""
    world = dist.get_world_size()
    weigh = [torch.arange(96.0).view(6, 16) * (r + 1) / 100 for r in range(world)]
    parts = [torch.randn(6, 16, generator=torch.Generator().manual_seed(200 + r)) * (r + 1)
             for r in range(world)]
    x = parts[rank].clone().requires_grad_()
    sbn = SyncBatchNorm(16)
    y = sbn(x)
    (y * weigh[rank]).sum().backward()
    bn = nn.BatchNorm1d(16)
    full = torch.cat(parts).requires_grad_()
    yf = bn(full)
    (yf * torch.cat(weigh)).sum().backward()
    assert full.grad is not None and x.grad is not None
    mine = slice(6 * rank, 6 * rank + 6)
    err = max((y - yf[mine]).abs().max().item(), (x.grad - full.grad[mine]).abs().max().item(),
              (sbn.running_mean - bn.running_mean).abs().max().item(),
              (sbn.running_var - bn.running_var).abs().max().item())
    print(f"sbn-check rank {rank} max error {err:.3g}", flush=True)


def ddp_bn(rank: int, out: Path, backend: str, sync: bool = False) -> None:
    """DDP + (Sync)BatchNorm; each rank sees data from its own distribution, and buffers
    are not broadcast, so only a real sync keeps the running stats equal across ranks."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    if sync:
        model = convert_sync_batchnorm(model)
    ddp = DDP(model, broadcast_buffers=False)  # deprecated in 2.13, still the meaning we need
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(6, 8, generator=gen) * (rank + 1) + rank
        y = torch.randn(6, 1, generator=gen)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), out / f"{backend}-{'sbn' if sync else 'bn'}-{rank}.pt")
    # torch's DDP sits in reference cycles that keep its process group alive; left to
    # interpreter exit, gloo's threads tear down mid-finalization and abort the process
    # ("terminate called without an active exception", seen once in CI on the plain
    # gloo run). Collect it while the group is still up, as benchmarks/ddp.py does.
    del ddp, opt
    gc.collect()


def ddp_sbn(rank: int, out: Path, backend: str) -> None:
    ddp_bn(rank, out, backend, sync=True)


def sampler_dcp(rank: int, out: Path, backend: str) -> None:
    """torch's DistributedSampler with no arguments, then a distributed checkpoint saved by
    both ranks (a shared tensor and one of each rank's own) and loaded into fresh models."""
    import torch.distributed.checkpoint as dcp

    world = dist.get_world_size()
    sampler = DistributedSampler(TensorDataset(torch.arange(10)), shuffle=True, seed=3)
    mine = list(sampler)
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    flat = sorted(i for part in everyone for i in (part or []))
    print(f"sampler rank {rank} {len(mine)} {flat}", flush=True)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = {"model": model.state_dict(), f"own{rank}": torch.full((2,), float(rank + 7))}
    dcp.save(state, checkpoint_id=str(out / "ckpt"))
    torch.manual_seed(1)
    fresh = nn.Linear(4, 3)
    target = {"model": fresh.state_dict(), f"own{rank}": torch.zeros(2)}
    dcp.load(target, checkpoint_id=str(out / "ckpt"))
    fresh.load_state_dict(target["model"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values(), strict=True))
    print(f"dcp rank {rank} model {same} own {target[f'own{rank}'].tolist()}", flush=True)


def mismatch(rank: int, out: Path, backend: str) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        dist.all_reduce(t)  # @torch-mismatch-0
    else:
        dist.broadcast(t, src=0)  # @torch-mismatch-1


def ddp_mismatch(rank: int, out: Path, backend: str) -> None:
    """torch's DDP reduces gradients from C++ during backward; the report must still name
    the user's ``backward()`` line, not torch's autograd frames."""
    ddp = DDP(nn.Linear(4, 1))
    loss = ddp(torch.ones(2, 4)).sum()
    if rank == 1:
        dist.all_reduce(torch.ones(3))  # @torch-ddp-extra
    loss.backward()  # @torch-ddp-backward


def peer_failure(rank: int, out: Path, backend: str) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(t)  # @torch-peer-wait


CASES = {f.__name__: f for f in (sbn_check, ddp_bn, ddp_sbn, sampler_dcp, mismatch,
                                 ddp_mismatch, peer_failure)}


def main() -> None:
    case, backend = sys.argv[1], sys.argv[2]
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(".")
    dist.init_process_group(backend)
    CASES[case](dist.get_rank(), out, backend)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
