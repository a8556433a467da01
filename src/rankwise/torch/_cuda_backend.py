"""Backend ``"rankwise"`` for CUDA tensors: torch's GPU stack under rankwise's checks.

torch asks a backend registered for ``cpu`` and ``cuda`` (``DEVICES``) once per group (a
Python ``ProcessGroup`` serves every device), so a group's CUDA plane is chosen here, as
the group is made: where this process sees a GPU, the members exchange their GPU's
identity (host and UUID). Each on its own GPU: rankwise's NCCL engine, a
``ProcessGroupNCCL`` underneath, beside the group's CPU engine (``DevicePair``), so
every CUDA collective of torch's DDP, FSDP2, DTensor or distributed checkpoint gets the
per-call checks (fingerprints to the ring neighbour on the control plane, mismatch and
deadlock reports naming each rank's file:line, failure reports, who-is-where) and the
bounded waits of the process's ledger. Two or more sharing one GPU (NCCL refuses that): no
CUDA engine, and CUDA tensors are staged through host memory on the CPU engine, as the
rankwise API does for backend ``"gloo"``. Cost next to ``"nccl"``: docs/gpu.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engines.device.pair import DevicePair
from ..engines.select import cuda_missing, exchange
from ..engines.torch.nccl import _gpu_identity, create_device_engine, resolve_device, shared_gpus

if TYPE_CHECKING:
    from ..api.world import World
    from ..core.group import ProcessGroup

__all__ = ["DEVICES", "attach_cuda"]

#: the devices backend "rankwise" serves (``torch.distributed.Backend.backend_capability``)
DEVICES = ["cpu", "cuda"]


def attach_cuda(world: World, group: ProcessGroup) -> str:
    """Give ``group`` its CUDA plane (collective over its members: every member calls
    it, in the order the groups are made); what CUDA tensors run on: ``"nccl"`` (or
    the test stand-in's device engine, ``RANKWISE_TENSOR_PATH=device``), ``"staged"``
    (the members share a GPU) or ``"none"`` (no GPU here)."""
    if isinstance(group.engine, DevicePair):
        return "nccl"
    if cuda_missing() is not None:
        return "none"
    device = resolve_device(world.device_id)
    ids = exchange(world.rendezvous, f"engine/{group.id}/rankwise-gpu", _gpu_identity(device),
                   group.size(), group.group_rank, group.timeout)
    if shared_gpus(ids):
        return "staged"
    host = group.engine
    group.engine = DevicePair(host, create_device_engine(group, world.rendezvous,
                                                         group.timeout, device))
    return "nccl"
