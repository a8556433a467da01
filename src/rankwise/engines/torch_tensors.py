"""How a torch engine sees the buffers the API hands it: the one thing that differs
between torch's gloo on host memory and NCCL (or its gloo stand-in) on tensors.

Why a seam of its own: the torch engine's logic (checks, bounded waits, the dtype
workarounds, abort) is the same whatever the buffers are; only the first step differs.
``HostArrays`` views the numpy arrays of rankwise's host path as CPU tensors sharing
their memory (no copy); ``DeviceTensors`` takes the flat torch tensors of the tensor
path as they are (CUDA tensors stay on their GPU: no numpy, no host copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import Call

__all__ = ["DeviceTensors", "HostArrays", "Tensors"]

_CPU = torch.device("cpu")


class Tensors:
    """The interface: ``raw`` (the buffer's bytes as a uint8 tensor), ``values`` (its
    elements as a tensor of the user's dtype), ``device`` (where scratch tensors go)."""

    device: torch.device = _CPU

    def raw(self, a: Any) -> torch.Tensor:
        raise NotImplementedError

    def values(self, a: Any, call: Call) -> torch.Tensor:
        raise NotImplementedError


class HostArrays(Tensors):
    """numpy views (rankwise's host path) as CPU tensors over the same memory."""

    def raw(self, a: Any) -> torch.Tensor:
        return torch.from_numpy(a.reshape(-1).view(np.uint8))

    def values(self, a: Any, call: Call) -> torch.Tensor:
        """bfloat16 is stored as uint16 in rankwise's host arrays."""
        if call.dtype is not None and call.dtype.kind == "bfloat16":
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)


class DeviceTensors(Tensors):
    """Flat torch tensors (the tensor path) as they are, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def raw(self, a: Any) -> torch.Tensor:
        t: torch.Tensor = a.view(torch.uint8)
        return t

    def values(self, a: Any, call: Call) -> torch.Tensor:
        t: torch.Tensor = a
        return t
