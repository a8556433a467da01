"""The NCCL engine: CUDA tensors moved by torch's ``ProcessGroupNCCL``, checked by rankwise.

Why it is the torch engine again: everything but the torch group is the same as on
torch-gloo (``TorchEngine``): the fingerprint ring on rankwise's control plane
(``RANKWISE_CHECK``), bounded waits that the control plane releases, and an abort of
the torch group when the job fails (``ProcessGroupNCCL.abort()``: ``ncclCommAbort``
on its communicators, which ends kernels waiting for peers, instead of NCCL's
watchdog minutes later). What differs is passed in: the group, the tensors as they
are (``DeviceTensors``: no numpy, no host copy) and a waiter that polls the kernel's
completion instead of a timed ``wait`` (see ``engines.torch.wait``). The group is built over a
view of the rankwise store, never through torch's global init; NCCL's communicator
is made lazily by torch on the group's first collective.

Device: ``init_process_group(device_id=...)``, else ``LOCAL_RANK``, else the current
device, chosen before any I/O (``resolve_device``). Two ranks of one NCCL group on one
GPU is an error NCCL reports obscurely or hangs on; the members compare their GPUs
(host identity and GPU UUID) when the group is made and every rank names the pair.

``RANKWISE_TENSOR_PATH=device`` (tests, see ``wire.device``): the same engine class
drives torch's gloo over CPU tensors, so every line above but the NCCL group itself
runs on a machine without a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import DistError, InvalidArgument
from ...wire.device import tensor_path
from ..base import Engine

if TYPE_CHECKING:
    from ...core.group import ProcessGroup

__all__ = ["create_device_engine", "nccl_missing", "resolve_device", "shared_gpus"]

#: the test stand-in's name: reports then say "kernel" as they would on NCCL
STAND_IN = "nccl(gloo stand-in)"


def nccl_missing() -> str | None:
    """Why no NCCL engine can run here (None when it can), without any I/O."""
    if tensor_path() == "device":
        return None
    from ..select import cuda_missing

    why = cuda_missing()
    if why is not None:
        return why
    import torch.distributed as tdist

    if not tdist.is_nccl_available():
        return "this torch is built without NCCL"
    return None


def resolve_device(device_id: Any = None) -> Any:
    """The GPU this rank's NCCL groups use: ``device_id``, else ``LOCAL_RANK``, else the
    current device; ``InvalidArgument`` (before any I/O) for one that does not exist."""
    import torch

    if tensor_path() == "device":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{count} visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    if device_id is not None:
        try:
            device = torch.device("cuda", device_id) if isinstance(device_id, int) \
                else torch.device(device_id)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgument(f"device_id={device_id!r} is not a device ({exc})") from None
        if device.type != "cuda":
            raise InvalidArgument(f"device_id={device_id!r}: NCCL needs a CUDA device")
        index = torch.cuda.current_device() if device.index is None else device.index
        how = f"device_id={device_id!r}"
    elif os.environ.get("LOCAL_RANK", "").strip():
        raw = os.environ["LOCAL_RANK"]
        try:
            index = int(raw)
        except ValueError:
            raise InvalidArgument(f"LOCAL_RANK={raw!r} is not an integer") from None
        how = f"LOCAL_RANK={index}"
    else:
        index, how = torch.cuda.current_device(), "the current device"
    if not 0 <= index < count:
        raise InvalidArgument(f"{how} picks GPU {index}, but this process sees {seen} GPUs; "
                              "pass device_id= or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def _gpu_identity(device: Any) -> str:
    """What makes two processes' GPUs the same one: the host and the GPU's UUID."""
    import torch

    from ...shmem.host import host_identity

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"{host_identity()}|{uuid if uuid is not None else device}|{device}"


def shared_gpus(identities: list[str]) -> list[tuple[int, int, str]]:
    """Pairs of group ranks (first, later, device) whose identities name one GPU."""
    first: dict[str, int] = {}
    pairs = []
    for rank, ident in enumerate(identities):
        key = ident.rsplit("|", 1)[0]
        if key in first:
            pairs.append((first[key], rank, ident.rsplit("|", 1)[1]))
        else:
            first[key] = rank
    return pairs


def create_device_engine(group: ProcessGroup, store: Any, timeout: float,
                         device: Any) -> Engine:
    """The engine for ``group``'s CUDA tensors (collective over its members)."""
    from .engine import TORCH_GRACE, TorchEngine
    from .tensors import DeviceTensors

    if tensor_path() == "device":
        return TorchEngine.create(group, store, timeout, prefix="device", name=STAND_IN,
                                  tensors=DeviceTensors(device), poll=True)
    import torch.distributed as tdist

    from ...store.prefix import PrefixStore
    from ...store.torch_views import TorchStoreView
    from ..base import check_mode
    from ..select import exchange

    check = check_mode()
    ids = exchange(store, f"engine/{group.id}/gpu", _gpu_identity(device), group.size(),
                   group.group_rank, timeout)
    pairs = shared_gpus(ids)
    if pairs:
        a, b, where = pairs[0]
        raise DistError(
            f"ranks {group.ranks[a]} and {group.ranks[b]} of {group.name} would share one GPU "
            f"({where} on the same host): NCCL needs a GPU per rank. Give each rank its own "
            "(device_id=, or LOCAL_RANK with one GPU per local rank), or use backend 'gloo' "
            "to stage CUDA tensors through host memory")
    tstore = TorchStoreView(PrefixStore(f"engine/{group.id}/nccl/", store))
    opts = tdist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout + TORCH_GRACE)
    pg = tdist.ProcessGroupNCCL(tstore, group.group_rank, group.size(), opts)
    return TorchEngine(group, pg, check, tstore, name="nccl",
                       tensors=DeviceTensors(device), poll=True)
