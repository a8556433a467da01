"""Which engine moves a group's data: decided per group, agreed by every member.

Why per group and through the store: a subgroup may live on one host while the world
spans several, so the decision belongs to the group; and ``LOCAL_WORLD_SIZE`` says
nothing reliable about which ranks share memory (gloo's own review of its shm path
flagged that). Each member publishes where it runs — hostname, boot id, the device of
/dev/shm, its pid namespace and the CPU architecture — and the shared-memory engine is
used only when all of these are equal. Setting it up can still fail on one rank (a full
/dev/shm), so a second round makes every member learn every outcome: the group uses
shared memory only if it worked everywhere, and never splits across engines.

``RANKWISE_ENGINE`` = ``auto`` (default: shm for a group on one host, the tiered engine
for one with as many ranks on each of several hosts, else tcp), ``tcp`` (always the
message engine), ``shm`` or ``tiers`` (that engine or an error saying why not) or ``torch-gloo``
(torch's gloo moves the data, rankwise checks it: ``engines.torch.engine``). The backend name
``"torch-gloo"`` asks for that engine whatever the environment says; ``"gloo"`` is
rankwise's own engine. A backend that names NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``)
adds the NCCL engine for CUDA tensors beside that choice (``engines.device.pair``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import settings
from ..errors import DistError, InvalidArgument
from ..shmem.host import host_identity
from ..store.gather import gather
from ..wire.device import tensor_path
from .backends import parse_backend
from .base import Engine, EngineUnavailable

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["ENGINES", "ENGINE_BACKENDS", "ENGINE_ENV", "choose_engine", "cuda_missing",
           "exchange", "host_identity", "host_layout", "requested_engine"]

log = logging.getLogger("rankwise")

ENGINE_ENV = "RANKWISE_ENGINE"
ENGINES = settings.choices(ENGINE_ENV)


#: backend names that pick an engine themselves (every other CPU backend name leaves the
#: choice to ``RANKWISE_ENGINE``)
ENGINE_BACKENDS = {"torch-gloo": "torch-gloo"}


def requested_engine(backend: str | None = None) -> str:
    """The engine a group of ``backend`` asks for (the backend name when it names one,
    else ``RANKWISE_ENGINE``), validated before any I/O: a torch engine without torch
    installed is an error here, not after the rendezvous."""
    by_backend = ENGINE_BACKENDS.get(parse_backend(backend).cpu if backend else "")
    value = by_backend
    if value is None:
        value = settings.choice(ENGINE_ENV)
    if value.startswith("torch-") and importlib.util.find_spec("torch") is None:
        how = f"backend {backend!r}" if by_backend else f"{ENGINE_ENV}={value}"
        raise InvalidArgument(f"{how} needs torch, which is not installed: pip install torch, "
                              "or use rankwise's own engine (backend 'gloo')")
    return value


def cuda_missing() -> str | None:
    """Why no CUDA engine can run here (None when torch sees a CUDA device), found without
    any I/O and without importing torch when it is not installed."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        return ("torch sees no CUDA device (torch.cuda.is_available() is False)" if built
                else f"this torch ({torch.__version__}) is built without CUDA")
    return None


def exchange(store: Any, key: str, value: str, size: int, rank: int,
             timeout: float) -> list[str]:
    """Every member's ``value`` for ``key``, in group-rank order (one store round of
    O(size) requests: group rank 0 gathers and publishes)."""
    values = json.loads(gather(store, key, value, size, rank, timeout))
    if not isinstance(values, list) or len(values) != size:
        raise DistError(f"store round {key!r}: a malformed answer from group rank 0")
    return [str(v) for v in values]


def choose_engine(group: ProcessGroup, store: Any, timeout: float,
                  hosts: list[str] | None = None, device: Any = None) -> Engine:
    """The engine for ``group`` (its message engine unless shared memory can serve every
    member; paired with the NCCL engine when its backend names NCCL). Collective over
    the group's members: each must call it, in group order. ``hosts``: every member's
    ``host_identity()`` in group-rank order, when a round already brought them
    (``new_group``'s order check); else one round here. ``device``: this rank's GPU for
    NCCL (``nccl.resolve_device``; resolved here when None)."""
    host = _host_engine(group, store, timeout, hosts)
    if not (group.backend and parse_backend(group.backend).nccl) \
            and tensor_path() != "device":
        return host
    from .device.pair import DevicePair
    from .torch.nccl import create_device_engine, resolve_device

    try:
        cuda = create_device_engine(group, store, timeout,
                                    resolve_device() if device is None else device)
    except BaseException:
        host.close()
        raise
    return DevicePair(host, cuda)


def _host_engine(group: ProcessGroup, store: Any, timeout: float,
                 hosts: list[str] | None) -> Engine:
    """The engine for host memory (numpy arrays, CPU tensors)."""
    want = requested_engine(group.backend)
    n, me = group.size(), group.group_rank
    if want == "torch-gloo":
        from .torch.engine import TorchEngine

        return TorchEngine.create(group, store, timeout)
    if want == "tcp" or n == 1:
        return group.messages
    prefix = f"engine/{group.id}"
    if hosts is None:
        hosts = exchange(store, f"{prefix}/host", host_identity(), n, me, timeout)
    apart = sorted({h.split("|", 1)[0] for h in hosts})
    if len(set(hosts)) == 1:
        if want == "tiers":
            raise EngineUnavailable(f"{ENGINE_ENV}=tiers, but every rank of {group.name} is "
                                    f"on one host (hosts {apart}); unset it to use shared memory")
        return _agreed(group, store, timeout, want, lambda: _shm_engine(group, store, timeout))
    if want == "shm":
        raise EngineUnavailable(
            f"{ENGINE_ENV}=shm, but the ranks of {group.name} do not share one host "
            f"(hosts {apart}, or different containers/boots); unset it to use tcp "
            "between hosts")
    layout = host_layout(hosts)
    if layout is None:
        if want == "tiers":
            raise EngineUnavailable(
                f"{ENGINE_ENV}=tiers, but {group.name} does not have the same number of "
                f"ranks, two or more, on each of its hosts {apart}; unset it to use tcp")
        return group.messages
    return _agreed(group, store, timeout, want,
                   lambda: _tiered_engine(group, store, timeout, layout))


def host_layout(hosts: Sequence[str]) -> list[list[int]] | None:
    """The group ranks on each host (hosts in order of their lowest member; ``hosts``: every
    member's host identity in group-rank order), when the tiered engine fits them: two hosts or
    more, each with the same number of members, two or more. None otherwise."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    layout = list(by_host.values())
    sizes = {len(members) for members in layout}
    if len(layout) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    return layout


def _agreed(group: ProcessGroup, store: Any, timeout: float, want: str,
            build: Callable[[], Engine]) -> Engine:
    """``build()``'s engine if it could be built on every member, else the message engine
    everywhere (or an error, when ``want`` named the engine): one round of outcomes."""
    n, me = group.size(), group.group_rank
    engine: Engine | None = None
    try:
        engine = build()
        outcome = "ok"
    except EngineUnavailable as exc:
        outcome = str(exc) or "unavailable"
    outcomes = exchange(store, f"engine/{group.id}/ok", outcome, n, me, timeout)
    failed = [(r, o) for r, o in enumerate(outcomes) if o != "ok"]
    if not failed:
        assert engine is not None
        return engine
    if engine is not None:
        engine.close()
    rank, why = failed[0]
    if want != "auto":
        raise EngineUnavailable(f"{ENGINE_ENV}={want}, but {group.name} cannot use shared "
                                f"memory: on group rank {rank}, {why}")
    if me == 0:
        log.warning("rankwise: %s uses tcp, not shared memory: on group rank %d, %s",
                    group.name, rank, why)
    return group.messages


def _shm_engine(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    """Build the shared-memory engine (imported here: only same-host groups need it)."""
    try:
        from .shm_engine import ShmEngine
    except ImportError as exc:
        raise EngineUnavailable(f"the shared-memory engine cannot load ({exc})") from exc
    engine: Engine = ShmEngine.create(group, store, timeout)
    return engine


def _tiered_engine(group: ProcessGroup, store: Any, timeout: float,
                   layout: list[list[int]]) -> Engine:
    """Build the tiered engine (imported here: only groups spread over hosts need it)."""
    try:
        from .tiers import TieredEngine
    except ImportError as exc:
        raise EngineUnavailable(f"the shared-memory engine cannot load ({exc})") from exc
    engine: Engine = TieredEngine.create(group, store, timeout, layout)
    return engine
