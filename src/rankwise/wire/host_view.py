"""A numpy view of a CPU torch tensor's memory that leaves the tensor as it was.

Why not ``Tensor.numpy()``: it marks the tensor's storage non-resizable for good (torch
cannot follow the array's raw pointer), so a user's later
``tensor.untyped_storage().resize_(0)`` fails with "Trying to resize storage that is not
resizable". FSDP1 frees every gathered parameter that way after a backend has gathered
into it. This view reads the data pointer instead (numpy's ``__array_interface__``, no
copy) and keeps the tensor's storage alive through the array's base, as ``numpy()`` kept
the tensor; resizing the storage while a call runs on it is then the user's race, as it
is on gloo.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["host_view", "keep_storage_only"]


class _Memory:
    """The array's base: describes the memory to numpy and owns a reference to it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, ptr: int, count: int, typestr: str, owner: Any) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (count,),
                                    "typestr": typestr, "version": 3}
        self.owner = owner


def host_view(t: Any, storage: np.dtype[Any], owner: Any) -> npt.NDArray[Any]:
    """The flat, writable view of the contiguous CPU tensor ``t``'s elements, typed as
    ``storage`` (same width as ``t``'s dtype); ``owner`` (the tensor, or its storage)
    stays alive while the view does."""
    count = t.numel()
    if count == 0:  # no memory to point at (the pointer may be null)
        return np.empty(0, storage)
    return np.asarray(_Memory(t.data_ptr(), count, storage.str, owner))


def keep_storage_only(view: Any, t: Any) -> None:
    """Make a ``host_view`` of ``t`` keep ``t``'s storage alive instead of ``t`` (a cache
    of views must not keep its tensors alive); anything else is left as it is."""
    memory = getattr(view, "base", None)
    if isinstance(memory, _Memory):
        memory.owner = t.untyped_storage()
