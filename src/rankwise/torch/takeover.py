"""A plain torch script's groups on backend "rankwise", with what it asked for underneath.

``rankwise_autoload`` (torch's ``torch.backends`` entry point) routes
``torch.distributed.init_process_group`` and ``new_group`` here when
``RANKWISE_TORCH_CHECKS`` is ``cpu`` or ``on`` (``rankwise run`` sets ``cpu`` by default).
A group asked of ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"`` or torch's default
(``None``) is made as backend ``"rankwise"`` whose engine is what was asked for: torch's
own gloo for CPU tensors (engine ``torch-gloo``: the same ``ProcessGroupGloo`` calls the
script would make, so the same bits) and NCCL for CUDA tensors. Every collective then gets
rankwise's per-call checks and reports; a framework that writes ``"gloo"`` into its own
``init_process_group`` gets them as well.

``cpu`` leaves a group that names NCCL on a machine with a GPU exactly as asked: rankwise's
NCCL engine has not yet been verified on a GPU (``scripts/gpu-check``), so checking CUDA
groups is ``on`` only. Any other backend (``"mpi"``, ``"ucc"``, a plugin, ``"rankwise"``
itself) is always left as asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from rankwise_autoload import ENV, mode

from . import _register
from ._backend import BACKEND_NAME, TorchProcessGroup

__all__ = ["init_process_group", "new_group", "underneath"]

#: the (device, backend) pairs taken over: gloo for CPU tensors (torch's gloo underneath),
#: NCCL for CUDA tensors, gloo for CUDA tensors (staged through host memory, as on gloo)
_TAKEN = frozenset((("cpu", "gloo"), ("cuda", "nccl"), ("cuda", "gloo")))


def _devices(backend: str | None, cuda: bool) -> dict[str, str] | None:
    """torch's device -> backend map of a request; None for a backend left as asked."""
    name = "undefined" if backend is None else str(backend).strip().lower()
    if name == "undefined":  # torch's default: gloo, and NCCL where a GPU is usable
        return {"cpu": "gloo", "cuda": "nccl"} if cuda else {"cpu": "gloo"}
    if name == "gloo":
        return {"cpu": "gloo", "cuda": "gloo"}
    if name == "nccl":
        return {"cuda": "nccl"}
    devices: dict[str, str] = {}
    for part in name.split(","):
        device, sep, backend_name = part.strip().partition(":")
        if not sep or (device, backend_name) not in _TAKEN or device in devices:
            return None
        devices[device] = backend_name
    return devices


def underneath(backend: str | None, checks: str, cuda: bool) -> str | None:
    """The rankwise engine string for a group asked of ``backend`` under ``checks``
    (:data:`rankwise_autoload.MODES`), or None to make it as asked. ``cuda``: whether
    torch sees a usable GPU (only torch's default asks for NCCL by it)."""
    if checks == "off":
        return None
    devices = _devices(backend, cuda)
    if devices is None or "cpu" not in devices and "nccl" not in devices.values():
        return None
    nccl = "nccl" in devices.values()
    if nccl and checks != "on":
        return None
    return "cpu:torch-gloo,cuda:nccl" if nccl else "cpu:torch-gloo"


def _say(text: str) -> None:
    print(f"rankwise: {text}", file=sys.stderr, flush=True)


def _describe(asked: str | None, engine: str) -> str:
    what = "torch's gloo" + (" for CPU tensors, NCCL for CUDA tensors" if "nccl" in engine
                             else "")
    return (f"checks on ({ENV}={mode()}): init_process_group({asked!r}) runs as backend "
            f"{BACKEND_NAME!r} over {what}; `rankwise run --checks=off` runs it as asked")


def init_process_group(original: Callable[..., Any], backend: str | None = None,
                       *args: Any, **kwargs: Any) -> Any:
    """torch's ``init_process_group``, on backend "rankwise" when the switch says so."""
    checks = mode()
    engine = underneath(backend, checks, torch.cuda.is_available())
    if engine is None:
        if checks == "cpu" and _devices(backend, torch.cuda.is_available()) is not None:
            _say(f"checks off for CUDA: init_process_group({backend!r}) runs as asked "
                 f"({ENV}=on checks CUDA groups too; not yet verified on a GPU)")
        return original(backend, *args, **kwargs)
    _register.engine_backend = engine
    try:
        result = original(BACKEND_NAME, *args, **kwargs)
    finally:
        _register.engine_backend = None
    if tdist.get_rank() == 0:
        _say(_describe(backend, engine))
    return result


def new_group(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's ``new_group``: a group asked of a backend the default group took over is
    made on backend "rankwise" too (``backend=None`` already is)."""
    position = 2  # new_group(ranks, timeout, backend, ...)
    asked = kwargs.get("backend", args[position] if len(args) > position else None)
    if asked is None or not _taken_over() or \
            underneath(asked, mode(), torch.cuda.is_available()) is None:
        return original(*args, **kwargs)
    if "backend" in kwargs or len(args) <= position:
        kwargs["backend"] = BACKEND_NAME
    else:
        args = (*args[:position], BACKEND_NAME, *args[position + 1:])
    return original(*args, **kwargs)


def _taken_over() -> bool:
    """Whether the default group is backend "rankwise" (then subgroups join it)."""
    if not tdist.is_initialized():
        return False
    from torch.distributed.distributed_c10d import _get_default_group

    return isinstance(_get_default_group(), TorchProcessGroup)
