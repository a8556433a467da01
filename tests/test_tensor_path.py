"""Issue 13's GPU data plane, tested without a GPU: backend strings, device choice, and
the tensor path (``RANKWISE_TENSOR_PATH``, see ``rankwise.wire.device``) in real
processes: torch tensors go to the NCCL engine's own class driving torch's gloo
("nccl-stand-in"), or are staged through host copies onto rankwise's engine
("staged"), exactly as CUDA tensors would be. The differential suite runs on both
paths too (``tests/test_differential.py``, marker ``tensor_paths``).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
from _error_cases import assert_every_rank, line_of

import rankwise as dist
from rankwise.engines.backends import parse_backend
from rankwise.engines.torch.nccl import STAND_IN, resolve_device, shared_gpus
from rankwise.errors import InvalidArgument
from rankwise.testing import run_ranks

torch = pytest.importorskip("torch")

ME = os.path.basename(__file__)
PATHS = {"nccl-stand-in": "device", "staged": "staged"}


# --- backend strings and device choice (no I/O) ------------------------------------------

@pytest.mark.parametrize("backend,cpu,nccl,name", [
    ("nccl", "gloo", True, "nccl"),
    ("cuda:nccl", "gloo", True, "cuda:nccl"),
    ("cpu:gloo,cuda:nccl", "gloo", True, "cpu:gloo,cuda:nccl"),
    ("cuda:nccl,cpu:torch-gloo", "torch-gloo", True, "cuda:nccl,cpu:torch-gloo"),
    ("cpu:tcp,cuda:gloo", "tcp", False, "cpu:tcp,cuda:gloo"),
    ("cpu:torch-gloo", "torch-gloo", False, "torch-gloo"),
    ("gloo", "gloo", False, "gloo"),
])
def test_backend_strings(backend: str, cpu: str, nccl: bool, name: str) -> None:
    spec = parse_backend(backend)
    assert (spec.cpu, spec.nccl, spec.name) == (cpu, nccl, name)


@pytest.mark.parametrize("backend,needle", [
    ("cpu:nccl", "NCCL moves CUDA tensors only"),
    ("cuda:nccl,nccl", "two backends for cuda"),
    ("gloo,cpu:tcp", "two backends for cpu"),
    ("tpu:xla", "unknown device 'tpu'"),
    ("cuda:mpi", "unknown backend 'mpi'"),
    ("mpi", "unknown backend 'mpi'"),
])
def test_bad_backend_strings(backend: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        parse_backend(backend)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that sees two GPUs (current: 0), the test switch off."""
    monkeypatch.delenv("RANKWISE_TENSOR_PATH", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.usefixtures("two_gpus")
def test_device_from_device_id_then_local_rank_then_current(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device() == torch.device("cuda", 1)
    assert resolve_device(0) == torch.device("cuda", 0)  # device_id wins
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(InvalidArgument, match=r"LOCAL_RANK=3 picks GPU 3, but this process "
                       r"sees 2 visible \(CUDA_VISIBLE_DEVICES=4,5\)"):
        resolve_device()
    with pytest.raises(InvalidArgument, match="device_id='cpu': NCCL needs a CUDA device"):
        resolve_device("cpu")
    with pytest.raises(InvalidArgument, match="device_id=5 picks GPU 5"):
        resolve_device(5)


def test_ranks_sharing_a_gpu_are_named() -> None:
    ids = ["hostA|GPU-1|cuda:0", "hostA|GPU-2|cuda:1", "hostB|GPU-1|cuda:0",
           "hostA|GPU-1|cuda:0"]
    assert shared_gpus(ids) == [(0, 3, "cuda:0")]
    assert shared_gpus(ids[:3]) == []


def test_bad_switch_value_fails_before_io(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_TENSOR_PATH", "gpu")
    with pytest.raises(InvalidArgument, match="RANKWISE_TENSOR_PATH='gpu'"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0,
                                world_size=2)


# --- mismatches and who-is-where on the NCCL engine's class ------------------------------

def _mismatch(rank: int, world: int, case: str) -> None:
    t = torch.arange(4, dtype=torch.float32) + rank
    if case == "count":
        if rank == 1:
            dist.all_reduce(torch.ones(5))  # CALL:count-odd
        else:
            dist.all_reduce(t)  # CALL:count-rest
    elif case == "plane":  # host memory where the others pass (what stands for) CUDA
        if rank == 1:
            dist.all_reduce(t.numpy())  # CALL:plane-odd
        else:
            dist.all_reduce(t)  # CALL:plane-rest
    else:
        for _ in range(3):  # confirmed calls: async checks batch their fingerprints
            dist.all_reduce(t)
        if rank == 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # CALL:op-odd
        else:
            dist.all_reduce(t)  # CALL:op-rest
    dist.barrier()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", ["async", "sync"])
@pytest.mark.parametrize("case,odd,rest", [
    ("count", "all_reduce(float32 x 5, op=SUM)", "all_reduce(float32 x 4, op=SUM)"),
    ("op", "all_reduce(float32 x 4, op=MAX)", "all_reduce(float32 x 4, op=SUM)"),
    ("plane", "all_reduce(float32 x 4, op=SUM) at", "all_reduce(float32 x 4, op=SUM) on CUDA"),
])
@pytest.mark.procs
def test_mismatch_on_the_nccl_engine_class(case: str, odd: str, rest: str,
                                           check: str) -> None:
    """CUDA tensors' calls are checked on the control plane: every rank raises
    ``CollectiveMismatch`` naming both calls (never a hang, never wrong data)."""
    results = run_ranks(_mismatch, 3, args=(case,), timeout=150,
                        init_kwargs={"backend": "nccl"},
                        env={"RANKWISE_TENSOR_PATH": "device", "RANKWISE_CHECK": check})
    assert_every_rank(results, "CollectiveMismatch", odd, rest,
                      f"{ME}:{line_of(__file__, f'CALL:{case}-odd')}",
                      f"{ME}:{line_of(__file__, f'CALL:{case}-rest')}", within=60.0)


def _stuck(rank: int, world: int) -> None:
    t = torch.ones(4)
    for step in range(2):  # #1 confirms the call site: #2 goes straight to the engine
        if rank == 1 and step == 1:  # computing far past the timeout (a fault, not sync)
            busy_until = time.monotonic() + 6.0
            while time.monotonic() < busy_until:
                sum(range(1000))
        dist.all_reduce(t)  # CALL:stuck


@pytest.mark.timeout(120)
@pytest.mark.procs
def test_kernel_not_finished_told_apart_from_never_called() -> None:
    results = run_ranks(_stuck, 2, timeout=60, init_kwargs={"backend": "nccl", "timeout": 3.0},
                        env={"RANKWISE_TENSOR_PATH": "device"})
    call = "all_reduce(float32 x 4, op=SUM) on CUDA"  # the plane the call's tensors took
    assert_every_rank(results, "DistTimeout", f"timed out after 3s in {call}",
                      ranks=[0], within=15.0)
    message = results[0].message
    assert re.search(rf"rank 0: enqueued {re.escape(call)} #2 of .* on "
                     rf"{re.escape(STAND_IN)} at {ME}:{line_of(__file__, 'CALL:stuck')}.*, "
                     r"kernel not finished after \d", message), message
    assert f"; never called {call} #2" in message, message


# --- DDP on the tensor path ---------------------------------------------------------------

def _train(rank: int, world: int) -> dict[str, Any]:
    from rankwise.nn import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # different weights: DDP broadcasts rank 0's
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                    torch.nn.Linear(5, 2)), bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().sum().backward()
        opt.step()
    return {"engine": dist.group.WORLD.engine_name(),
            "params": [p.detach().clone().tolist() for p in model.parameters()]}


@pytest.mark.timeout(240)
@pytest.mark.procs
def test_ddp_on_the_tensor_paths_matches_the_host_path() -> None:
    """DDP's buckets, broadcasts and gradient all_reduces through the NCCL engine class
    and through host staging give the same parameters, bit for bit, as the host path."""
    runs = {"host": run_ranks(_train, 2, timeout=150)}
    for name, path in PATHS.items():
        backend = "nccl" if path == "device" else "gloo"
        runs[name] = run_ranks(_train, 2, timeout=150, init_kwargs={"backend": backend},
                               env={"RANKWISE_TENSOR_PATH": path})
    for name, results in runs.items():
        for res in results:
            assert res.ok, f"{name} rank {res.rank}: {res.error_type}: {res.message}\n" \
                           f"{res.traceback}"
    assert STAND_IN in runs["nccl-stand-in"][0].value["engine"]
    reference = runs["host"][0].value["params"]
    for name, results in runs.items():
        for res in results:
            assert res.value["params"] == reference, f"{name} rank {res.rank} differs"
