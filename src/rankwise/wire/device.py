"""Tensors that stay tensors: CUDA tensors on their way to a device engine or to host memory.

Why a path of their own: a CUDA tensor has no numpy view, so the flat data the engines
move is the tensor itself (``Buffer.array`` is a flat torch tensor and its ``DType`` has
``tensor=True``). The API hands such a call to the group's device engine
(``engines.device``): NCCL moves the tensors where the group has it, else the call is
staged through host memory (``to_host`` before, ``to_tensor`` after) onto the group's
CPU engine, as torch's gloo does with CUDA tensors. The few array operations the API
performs itself (``same_memory``, ``concat``, ``flat_copy``) work on both kinds.

``RANKWISE_TENSOR_PATH`` (tests only: there is no GPU to test on) sends CPU torch
tensors down the same path: ``device``: every group gets a device engine, the NCCL
engine's own class driving torch's gloo over CPU tensors (and ``"nccl"`` backends are
accepted without CUDA); ``staged``: tensors are staged through host copies onto the
group's CPU engine. Read by ``init_process_group`` (``tensor_path``), kept in a module
flag: the check sits on every call's path.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import settings

__all__ = ["TENSOR_PATH_ENV", "concat", "device_dtype", "flat", "flat_copy", "host_empty",
           "is_tensor", "same_memory", "tensor_path", "to_host", "to_tensor"]

TENSOR_PATH_ENV = "RANKWISE_TENSOR_PATH"
_MODES = ("", "device", "staged")
#: CPU torch tensors take the tensor path (the test switch is on; set by ``tensor_path``)
CPU_TENSORS = False


def tensor_path() -> str:
    """The test switch's value ("" when off), validated (``init_process_group`` calls this
    before any I/O, so a typo is an error rather than a silently untested path)."""
    global CPU_TENSORS
    mode = settings.choice(TENSOR_PATH_ENV)
    CPU_TENSORS = mode != ""
    return mode


_DEVICE_DTYPES: dict[int, Any] = {}


def device_dtype(d: Any) -> Any:
    """``d`` (a ``buffers.DType``) marked as travelling as a torch tensor."""
    v = _DEVICE_DTYPES.get(d.code)
    if v is None:
        v = _DEVICE_DTYPES[d.code] = dataclasses.replace(d, tensor=True)
    return v


def flat(t: Any) -> Any:
    """A contiguous tensor as 1-D with stride 1 (a tensor of 0 or 1 elements may carry
    any stride, and byte views need 1)."""
    f = t.reshape(-1)
    if f.stride(0) != 1:
        f = f.as_strided((f.numel(),), (1,), f.storage_offset())
    return f


def _torch() -> Any:
    return sys.modules["torch"]  # a tensor exists, so torch is imported


def is_tensor(x: Any) -> bool:
    return not isinstance(x, np.ndarray)


def to_host(x: Any, d: Any) -> npt.NDArray[Any]:
    """A host copy of the flat tensor ``x`` in ``d``'s numpy storage dtype (always a copy,
    also of a CPU tensor: what the engine writes must reach ``x`` only via ``to_tensor``)."""
    raw = x.view(_torch().uint8)
    raw = raw.clone() if raw.is_cpu else raw.cpu()
    arr: npt.NDArray[Any] = raw.numpy().view(d.storage)
    return arr


def host_empty(x: Any, d: Any) -> npt.NDArray[Any]:
    """Host memory for an output of ``x``'s size (its old contents are not needed)."""
    return np.empty(x.numel(), d.storage)


def to_tensor(arr: npt.NDArray[Any], x: Any) -> None:
    """Copy the host result ``arr`` back into the flat tensor ``x``."""
    torch = _torch()
    x.view(torch.uint8).copy_(torch.from_numpy(arr.reshape(-1).view(np.uint8)))


def same_memory(a: Any, b: Any) -> bool:
    """Whether two flat buffers (numpy views, or tensors) overlap in memory."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return bool(a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size())


def concat(parts: list[Any]) -> Any:
    if parts and is_tensor(parts[0]):
        return _torch().cat(parts)
    return np.concatenate(parts)


def flat_copy(x: Any) -> Any:
    return x.clone() if is_tensor(x) else x.copy()
