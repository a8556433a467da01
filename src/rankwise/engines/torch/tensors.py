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

from ...errors import InvalidArgument
from ..base import Call

__all__ = ["DeviceTensors", "HostArrays", "Tensors"]

_CPU = torch.device("cpu")


class Tensors:
    """The interface: ``raw`` (the buffer's bytes as a uint8 tensor), ``values`` (its
    elements as a tensor of the user's dtype), ``device`` (where scratch tensors go)."""

    device: torch.device = _CPU

    def raw(self, a: Any) -> torch.Tensor:
        raise NotImplementedError

    #: ``values`` hands its buffers back as they are (device tensors): a caller on the
    #: hot path may skip the call
    as_is = False

    def values(self, a: Any, call: Call) -> torch.Tensor:
        raise NotImplementedError

    def check(self, call: Call, arrays: tuple[Any, ...]) -> None:
        """``InvalidArgument`` (before any I/O) for a buffer this engine cannot move."""

    def holds(self, a: Any) -> bool:
        """``check`` would pass ``a``."""
        return True


#: arrays whose torch view ``HostArrays.values`` keeps, at most, and their largest size
_KEPT = 64
_KEPT_BYTES = 64 * 1024


class HostArrays(Tensors):
    """numpy views (rankwise's host path) as CPU tensors over the same memory."""

    def __init__(self) -> None:
        #: torch views of small arrays seen before, by id (see ``values``)
        self._kept: dict[int, tuple[Any, torch.Tensor]] = {}

    def raw(self, a: Any) -> torch.Tensor:
        return torch.from_numpy(a.reshape(-1).view(np.uint8))

    def values(self, a: Any, call: Call) -> torch.Tensor:
        """``a``'s elements as a tensor (bfloat16 is stored as uint16 in rankwise's host
        arrays), kept for a small array that may come again.

        Why kept: the API hands the same array to every call on a tensor it has seen
        before (``api.views``); a tensor made per call cost its own Python and, freed by
        gloo's worker thread after the op, a GIL hand-off there. An entry holds ``a``, so
        its id cannot be reused while it is kept; at most ``_KEPT`` small arrays are held.
        """
        entry = self._kept.get(id(a))
        bf16 = call.dtype is not None and call.dtype.kind == "bfloat16"
        if entry is not None and entry[0] is a and (entry[1].dtype is torch.bfloat16) == bf16:
            return entry[1]
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if bf16 \
            else torch.from_numpy(a)
        if a.nbytes <= _KEPT_BYTES:
            if len(self._kept) >= _KEPT:
                self._kept.clear()
            self._kept[id(a)] = (a, t)
        return t


class DeviceTensors(Tensors):
    """Flat torch tensors (the tensor path) as they are, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def device(self) -> torch.device:
        return self._device

    @device.setter
    def device(self, device: torch.device) -> None:
        self._device = device
        #: the CUDA device's number as ``Tensor.get_device()`` gives it; -1: the CPU (a
        #: tensor's ``is_cpu`` says), None: a device without a number (devices compared)
        self._index = -1 if device.type == "cpu" else device.index

    def check(self, call: Call, arrays: tuple[Any, ...]) -> None:
        """Every tensor is on the group's device: NCCL's communicator is bound to one
        GPU, and a tensor on another would fail obscurely inside NCCL (or hang). Read as
        ``is_cpu`` or the CUDA device's number (only CPU and CUDA tensors get here:
        ``wire.buffers.as_buffer``; a CPU one numbers -1), one loop, no ``enumerate``:
        ``a.device != device`` in an ``enumerate`` loop cost ~0.2 us more per call."""
        index = self._index
        for a in arrays:
            if index == -1:
                if not a.is_cpu:
                    self._refuse(call, arrays, a)
            elif a.get_device() != index if index is not None else a.device != self._device:
                self._refuse(call, arrays, a)

    def holds(self, a: Any) -> bool:
        """``a`` is on the group's device (``check`` without a call to name)."""
        index = self._index
        if index == -1:
            return bool(a.is_cpu)
        return bool(a.get_device() == index if index is not None else a.device == self._device)

    def _refuse(self, call: Call, arrays: tuple[Any, ...], a: Any) -> None:
        i = next(i for i, b in enumerate(arrays) if b is a)
        what = "the tensor" if len(arrays) == 1 else f"tensor {i} of the call"
        raise InvalidArgument(
            f"rank {call.group.port.rank}: {call.describe()}: {what} is on "
            f"{a.device}, but {call.group.name}'s NCCL communicator is on {self._device}; "
            "move it there (tensor.to(...)) or make the group on its device "
            "(init_process_group(device_id=...), torch.cuda.set_device)")

    def raw(self, a: Any) -> torch.Tensor:
        t: torch.Tensor = a.view(torch.uint8)
        return t

    as_is = True

    def values(self, a: Any, call: Call) -> torch.Tensor:
        t: torch.Tensor = a
        return t
