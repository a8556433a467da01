"""Issue 34: backend ``"rankwise"`` serves CUDA tensors. On this CPU machine: the
capability is registered, the choice between NCCL and staging is made from the members'
GPU identities (fakes), and the CUDA path's engine runs on its CPU stand-in
(``RANKWISE_TENSOR_PATH=device``: the NCCL engine class over gloo) under torch's
``init_process_group("cpu:rankwise,cuda:rankwise")``, with a mismatch named at the
user's file:line. On a GPU: ``scripts/gpu-check`` (``torch-stack``, ``fsdp-mismatch``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rankwise.engines.base import HOST_CAPS

torch = pytest.importorskip("torch")

from rankwise.testing import free_port, run_ranks

pytestmark = pytest.mark.torch


def test_the_backend_is_registered_for_cuda() -> None:
    import torch.distributed as tdist

    import rankwise.torch  # noqa: F401 - registers the backend

    assert tdist.Backend.backend_capability["rankwise"] == ["cpu", "cuda"]


@pytest.mark.parametrize("gpus,want", [(["h|GPU-a|cuda:0", "h|GPU-b|cuda:1"], "nccl"),
                                       (["h|GPU-a|cuda:0", "h|GPU-a|cuda:0"], "staged"),
                                       (["h|GPU-a|cuda:0"], "nccl")])
def test_ranks_on_their_own_gpus_get_nccl_and_ranks_sharing_one_are_staged(
        monkeypatch: pytest.MonkeyPatch, gpus: list[str], want: str) -> None:
    from rankwise.engines.device.pair import DevicePair
    from rankwise.torch import _cuda_backend as cb

    made: list[Any] = []
    monkeypatch.setattr(cb, "cuda_missing", lambda: None)
    monkeypatch.setattr(cb, "resolve_device", lambda device_id: "cuda:0")
    monkeypatch.setattr(cb, "_gpu_identity", lambda device: gpus[0])
    monkeypatch.setattr(cb, "exchange", lambda store, key, value, size, rank, timeout: gpus)
    monkeypatch.setattr(cb, "create_device_engine",
                        lambda group, store, timeout, device: made.append(device)
                        or SimpleNamespace(name="nccl"))
    host = SimpleNamespace(name="tcp", serial=True, framed=True, caps=HOST_CAPS)
    group = SimpleNamespace(engine=host, id=7, group_rank=0, timeout=5.0,
                            size=lambda: len(gpus))
    world = SimpleNamespace(device_id=None, rendezvous=None)
    assert cb.attach_cuda(world, group) == want  # type: ignore[arg-type]
    if want == "nccl":
        assert isinstance(group.engine, DevicePair) and group.engine.host is host
        assert made == ["cuda:0"]
    else:
        assert group.engine is host and not made, "staged: the CPU engine moves CUDA tensors"


def test_no_gpu_no_cuda_plane() -> None:
    from rankwise.torch._cuda_backend import attach_cuda

    group = SimpleNamespace(engine=object())
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert attach_cuda(SimpleNamespace(), group) == "none"  # type: ignore[arg-type]


def _on_the_stand_in(rank: int, world: int, port: int) -> dict[str, Any]:
    import torch.distributed as tdist

    import rankwise
    import rankwise.torch

    tdist.init_process_group("cpu:rankwise,cuda:rankwise",
                             init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    out: dict[str, Any] = {"engine": rankwise.group.WORLD.engine_name()}
    t = torch.full((4,), float(rank + 1))
    tdist.all_reduce(t)
    work = tdist.all_reduce(t, async_op=True)
    work.wait()
    out["sum"] = t.tolist()
    try:
        tdist.all_reduce(torch.ones(4 + rank))  # MISMATCH: 4 vs 5 elements
    except rankwise.CollectiveMismatch as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.procs
def test_torch_collectives_on_the_cuda_engines_stand_in_are_checked() -> None:
    results = run_ranks(_on_the_stand_in, 2, args=(free_port(),), init=False, timeout=120,
                        env={"RANKWISE_TENSOR_PATH": "device"})
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# MISMATCH" in text)
    for res in results:
        v = res.value
        assert "nccl(gloo stand-in)" in v["engine"], v["engine"]
        assert v["sum"] == [6.0] * 4
        assert f"test_torch_backend_cuda.py:{line}" in v.get("mismatch", ""), v
