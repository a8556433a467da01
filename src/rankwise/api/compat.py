"""The small torch.distributed names that only report facts: which backends exist, how
the process was launched, its node-local rank, the default timeout, deprecated aliases.

Each answers for rankwise, not for torch: ``is_gloo_available()`` is True because
``backend="gloo"`` works here (rankwise's engines serve it), ``is_nccl_available()`` is
True where rankwise's NCCL engine can run (torch with NCCL and a CUDA device).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from .. import settings
from ..errors import InvalidArgument
from ..identity.calls import COMM_LABEL
from ..wire.reduce_op import ReduceOp, coerce_reduce_op
from .init import BACKENDS, DEFAULT_TIMEOUT, get_backend
from .world import current

__all__ = [
    "default_pg_timeout", "get_backend_config", "get_default_backend_for_device",
    "get_node_local_rank", "get_pg_count", "is_backend_available", "is_gloo_available",
    "is_mpi_available", "is_nccl_available", "is_torchelastic_launched", "is_ucc_available",
    "is_xccl_available", "record_comm", "reduce_op", "supports_complex",
]

#: torch's deprecated spelling of ``ReduceOp``, still found in older scripts
reduce_op = ReduceOp

default_pg_timeout = timedelta(seconds=DEFAULT_TIMEOUT)


def is_gloo_available() -> bool:
    return True  # "gloo" is an alias of rankwise's CPU engines


def is_nccl_available() -> bool:
    from ..engines.torch.nccl import nccl_missing

    return nccl_missing() is None


def is_mpi_available() -> bool:
    return False


def is_ucc_available() -> bool:
    return False


def is_xccl_available() -> bool:
    return False


def is_backend_available(backend: str) -> bool:
    if not isinstance(backend, str):
        return False
    return backend.lower() in BACKENDS or (backend.lower() == "nccl" and is_nccl_available())


def get_default_backend_for_device(device: Any) -> str:
    """``"gloo"`` for the CPU (torch's answer, which rankwise accepts); other devices are
    refused here rather than by a later init that cannot serve them."""
    kind = str(getattr(device, "type", device)).split(":", 1)[0].lower()
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl" if is_nccl_available() else "gloo"  # gloo: staged through the host
    raise InvalidArgument(f"device {device!r}: rankwise moves CPU and CUDA tensors only; "
                          "use device 'cpu' (backend 'gloo') or 'cuda'")


def get_backend_config(group: Any = None) -> str:
    """torch's ``"device:backend"`` form of ``get_backend(group)``."""
    name = get_backend(group)
    return name if ":" in name else f"cpu:{name}"


def is_torchelastic_launched() -> bool:
    """True under torchrun (as torch: ``TORCHELASTIC_RUN_ID`` is set) and under
    ``rankwise run``, which exports the same env:// variables: code that asks this to
    choose env:// initialization then does the right thing under either launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or settings.flag("RANKWISE_LAUNCHED")


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``LOCAL_RANK`` from the launcher's environment, else ``fallback_rank`` (as torch)."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgument(f"LOCAL_RANK={raw!r} is not an integer") from None
    if fallback_rank is not None:
        return int(fallback_rank)
    raise InvalidArgument("LOCAL_RANK is not set (start the job with `rankwise run` or "
                          "torchrun) and no fallback_rank was given")


def get_pg_count() -> int:
    """How many process groups this rank belongs to, the default group included."""
    return len(current().groups)


def supports_complex(reduceOp: Any) -> bool:
    op = reduceOp if isinstance(reduceOp, ReduceOp) else coerce_reduce_op(reduceOp)
    return op.name not in ("MIN", "MAX", "BAND", "BOR", "BXOR")


@contextmanager
def record_comm(name: str) -> Iterator[None]:
    """torch 2.13's ``record_comm``: the collectives issued inside the block carry ``name``
    as their profiling title: the span name in ``RANKWISE_TRACE`` timelines (the op stays
    in its arguments) and the name of an ``async_op`` ``Work``. Blocks nest (the inner
    name wins); each thread and asyncio task has its own. Ranks may use different names:
    a label is never compared across ranks."""
    if not isinstance(name, str):
        raise InvalidArgument(f"record_comm takes a name (str), got {type(name).__name__}")
    token = COMM_LABEL.set(name)
    try:
        yield
    finally:
        COMM_LABEL.reset(token)
