"""The switch that puts rankwise's checks under a plain torch script, read at ``import torch``.

torch (2.5+) calls every ``torch.backends`` entry point while it imports
(``torch._import_device_backends``); rankwise's points at :func:`install`. With
``RANKWISE_TORCH_CHECKS`` unset or ``off`` it reads that one variable and returns. Set to
``cpu`` or ``on`` (``rankwise run`` sets ``cpu`` unless told ``--checks``), it wraps
``torch.distributed.init_process_group`` and ``new_group`` so that a group asked of
``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"`` or torch's default becomes backend
``"rankwise"`` over what was asked for (``rankwise.torch.takeover`` decides; it is imported
on the first call, never here).

Why a top-level module and not one inside ``rankwise``: importing any ``rankwise.*`` module
runs ``rankwise/__init__`` (numpy and the whole API, about half a second), which every
``import torch`` in the environment would pay, switch on or off.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ENV", "MODES", "install", "mode"]

ENV = "RANKWISE_TORCH_CHECKS"
#: ``off``: torch alone; ``cpu``: CPU groups checked, CUDA groups left as asked; ``on``:
#: CUDA groups checked too (rankwise's NCCL engine; not yet verified on a GPU)
MODES = ("off", "cpu", "on")
_refused: list[ImportError] = []  #: why rankwise could not take over (said once)


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """``RANKWISE_TORCH_CHECKS`` checked (the one place it is read); ``ValueError`` on a
    value that is not one of :data:`MODES`."""
    value = environ.get(ENV, "").strip().lower() or "off"
    if value not in MODES:
        raise ValueError(f"{ENV}={environ.get(ENV)!r} is not one of {', '.join(MODES)} "
                         "(off: torch alone; cpu: check CPU groups; on: CUDA groups too)")
    return value


def _lazy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` behind rankwise's decision, imported on the first call."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            from rankwise.torch import takeover
        except ImportError as exc:  # a torch outside rankwise's range: torch alone, said once
            if not _refused:
                _refused.append(exc)
                print(f"rankwise: checks off ({ENV}={mode()}), torch.distributed runs as "
                      f"asked: {exc}", file=sys.stderr, flush=True)
            return original(*args, **kwargs)
        return getattr(takeover, name)(original, *args, **kwargs)

    call.rankwise_takes_over = original  # type: ignore[attr-defined]
    return call


def install() -> None:
    """torch's entry point: wrap torch's group makers when the switch is on. Idempotent."""
    if mode() == "off":
        return
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:  # torch built without distributed, or imported in another order
        import torch.distributed

        if not torch.distributed.is_available():
            return
        import torch.distributed.distributed_c10d as c10d
    package = sys.modules["torch.distributed"]
    for name in ("init_process_group", "new_group"):
        original = getattr(c10d, name)
        if hasattr(original, "rankwise_takes_over"):
            continue
        wrapped = _lazy(name, original)
        setattr(c10d, name, wrapped)
        setattr(package, name, wrapped)
