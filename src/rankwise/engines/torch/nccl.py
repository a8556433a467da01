"""The NCCL engine: CUDA tensors moved by torch's ``ProcessGroupNCCL``, checked by rankwise.

Why it is the torch engine again: everything but the torch group is the same as on
torch-gloo (``TorchEngine``): the fingerprint ring on rankwise's control plane
(``RANKWISE_CHECK``), bounded waits that the control plane releases, and an abort of
the torch group when the job fails (``ProcessGroupNCCL.abort()``: ``ncclCommAbort``
on its communicators, which ends kernels waiting for peers, instead of NCCL's
watchdog minutes later). What differs is passed in: the group, the tensors as they
are (``DeviceTensors``: no numpy, no host copy) and a waiter that polls the kernel's
completion instead of a timed ``wait`` (see ``engines.torch.device_waits``). The group
is built over a view of the rankwise store, never through torch's global init; NCCL's
communicator is made at once, bounded (``first_collective``), not lazily by the user's first call.

Device: ``init_process_group(device_id=...)``, else ``LOCAL_RANK``, else the current
device, chosen before any I/O (``resolve_device``). Two ranks of one NCCL group on one
GPU is an error NCCL reports obscurely or hangs on; the members compare their GPUs
(host identity and GPU UUID) when the group is made and every rank names the pair.

``RANKWISE_TENSOR_PATH=device`` (tests, see ``wire.device``): the same engine class
drives torch's gloo over CPU tensors, so every line above but the NCCL group itself
runs on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ...errors import DistError, InvalidArgument
from ...wire.device import tensor_path
from ..base import Engine
from .failures import TORCH_ERRORS

if TYPE_CHECKING:
    from ...core.group import ProcessGroup
    from .engine import TorchEngine

__all__ = ["create_device_engine", "first_collective", "nccl_missing", "resolve_device",
           "shared_gpus"]

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
        except (*TORCH_ERRORS, TypeError) as exc:
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
    from .streams import CudaStreams, HostStreams
    from .tensors import DeviceTensors

    if tensor_path() == "device":
        engine = TorchEngine.create(group, store, timeout, prefix="device", name=STAND_IN,
                                    tensors=DeviceTensors(device), streams=HostStreams())
        first_collective(engine, timeout)
        return engine
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
    with _rankwise_handles_errors():
        pg = tdist.ProcessGroupNCCL(tstore, group.group_rank, group.size(), opts)
    engine = TorchEngine(group, pg, check, tstore, name="nccl",
                         tensors=DeviceTensors(device), streams=CudaStreams(device))

    views: list[Any] = []  #: the reverse group's store view (torch holds its C++ half)

    def reverse() -> Any:  # p2p from higher ranks to lower ones (``engines.torch.p2p``)
        views.append(TorchStoreView(PrefixStore(f"engine/{group.id}/nccl-p2p/", store)))
        with _rankwise_handles_errors():
            return tdist.ProcessGroupNCCL(views[-1], group.group_rank, group.size(), opts)
    engine.make_reverse = reverse
    first_collective(engine, timeout)
    return engine


#: torch's NCCL error handling (read when a ProcessGroupNCCL is built)
_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@contextlib.contextmanager
def _rankwise_handles_errors() -> Iterator[None]:
    """Build rankwise's NCCL groups with torch's own error handling off (0, unless the
    user chose a value): rankwise's book of works aborts the communicator before torch's
    timeout (``TORCH_GRACE`` later), and torch's default (3) would tear the whole
    process down when the aborted works report their error, instead of the error
    reaching the user as ``DistTimeout``/``PeerFailure``. Other torch groups keep it."""
    if _ERROR_HANDLING in os.environ:
        yield
        return
    os.environ[_ERROR_HANDLING] = "0"
    try:
        yield
    finally:
        os.environ.pop(_ERROR_HANDLING, None)


#: seconds communicator creation may take at least, whatever the group's timeout: NCCL's
#: init (topology discovery, bootstrap) takes a few seconds, more than a test's timeout
FIRST_MIN = 30.0
#: seconds between two looks at the control plane while the communicator is made
_FIRST_SLICE = 0.05


def first_collective(engine: TorchEngine, timeout: float) -> None:
    """Make NCCL's communicator now, bounded: torch makes it lazily in the group's first
    collective, and ``ncclCommInitRank`` blocks the calling thread until every rank has
    joined, so a peer that never comes would hang the user's first call for good. Here
    it is made by a one-element all_reduce on a helper thread, at group creation, while
    this thread watches the deadline and the control plane (a peer that failed)."""
    import torch

    from ...errors import DistTimeout
    from .engine import _keep, on_thread

    port = engine.group.port
    t = torch.zeros(1, device=engine.tensors.device)
    box: list[Any] = []

    def make() -> None:
        try:
            box.append(engine.pg.allreduce([t]))
        except TORCH_ERRORS as exc:
            box.append(exc)
    maker = threading.Thread(target=make, name="rankwise-nccl-init", daemon=True)
    maker.start()
    timeout = max(timeout, FIRST_MIN)
    deadline = time.monotonic() + timeout
    while True:
        if port.failure is not None:
            _keep(engine.pg)
            engine.waiter.stuck = True
            port.raise_failure()
        if box:
            if isinstance(box[0], TORCH_ERRORS):
                raise DistError(f"rank {port.rank}: {engine.name}'s communicator for "
                                f"{engine.group.name} could not be made: {box[0]}")
            if box[0].is_completed():
                box[0].wait()  # its own error, if any
                return
        if time.monotonic() >= deadline:
            engine.waiter.stuck = True
            on_thread(engine.pg.abort, "rankwise-torch-abort")
            where = "made" if box else "enqueued"
            raise DistTimeout(
                f"rank {port.rank}: {engine.name}'s communicator for {engine.group.name} "
                f"({engine.group.size()} ranks) was not {where} within {timeout:.0f}s (the "
                "group's first collective): a rank of the group did not join, or NCCL "
                "cannot reach it (NCCL_DEBUG=INFO shows which)")
        maker.join(_FIRST_SLICE / (1 if maker.is_alive() else 10))
