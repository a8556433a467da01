"""The numpy view of a torch tensor, kept from one backend call to the next.

Why: a training loop (a metric ``all_reduce``, DDP's bucket tensors, through rankwise's
API or torch's backend: both ask the one cache, ``api.plans.views``) hands the same few
tensors to every call, and viewing a tensor
afresh (``as_buffer``: seven attribute checks and a numpy view) is the largest
single part of a small call's Python. Imported only once a torch tensor is seen (it
imports torch). A cached view is reused
only while five cheap reads prove it still describes the tensor: the same Python object
(a weak reference: ids are reused), the same data pointer, shape, dtype and contiguity,
and no autograd (a tensor that requires grad always takes the full check, which may
refuse it). Anything else (``resize_``, ``set_``, ``.data = ...``, ``as_strided_``)
changes one of those and the tensor is viewed, and checked, again.

Each view carries a ``memo`` for what its user derives from it and would otherwise
rebuild per call (``api.plans.Plan``: an all_reduce's body and fingerprint per reduce op);
it goes when the view goes.

A view keeps its tensor's storage, not the tensor: entries leave with their tensors, and
a tensor whose storage was swapped (``set_``, ``.data = ...``) is viewed again on its
next call, so the old storage outlives the swap until then. So what is kept is bounded:
a view up to ``MAX_BYTES`` (DDP's default bucket of 25 MiB fits: its buckets live as long
as the model, and a 1 MiB bucket's fresh view was most of its call's host time), and
``MAX_KEPT`` bytes in all.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..wire.buffers import Buffer, as_buffer
from ..wire.host_view import keep_storage_only

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "MAX_KEPT", "TensorViews"]

MAX_BYTES = 32 << 20  #: tensors larger than this are viewed afresh on every call
MAX_KEPT = 1 << 30  #: bytes of kept views in all (past it new ones are not kept)
MAX_ENTRIES = 1024  #: live tensors remembered at once (past it the cache starts over)

#: (weak reference, data pointer, shape, dtype, view, memo)
_Entry = tuple["weakref.ref[torch.Tensor]", int, torch.Size, torch.dtype, Buffer,
               dict[Any, Any]]


class TensorViews:
    """``view(t)``: ``as_buffer(t, ..., writable=True)`` and a memo, remembered per
    tensor (within ``MAX_BYTES``, ``MAX_KEPT`` and ``MAX_ENTRIES``)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self.kept = 0  #: bytes of the kept views

    def __len__(self) -> int:
        return len(self._entries)

    def view(self, t: torch.Tensor, what: str) -> tuple[Buffer, dict[Any, Any] | None]:
        """The writable flat view of ``t`` and its memo (empty when the view is new; None
        when the view is not kept: nothing derived from it outlives the call); raises
        ``InvalidArgument`` as ``as_buffer`` does (a cached tensor was checked when it was
        first viewed)."""
        entry = self._entries.get(id(t))
        if entry is not None:
            ref, ptr, shape, dtype, buf, memo = entry
            if (ref() is t and t.data_ptr() == ptr and t.shape == shape and t.dtype is dtype
                    and not t.requires_grad and t.is_contiguous()):
                return buf, memo
            del self._entries[id(t)]  # stale: its storage goes now, not at the next view
            self.kept -= buf.nbytes
        buf = as_buffer(t, what, writable=True)
        if t.requires_grad or not 0 < buf.nbytes <= MAX_BYTES or \
                self.kept + buf.nbytes > MAX_KEPT:
            return buf, None
        fresh: dict[Any, Any] = {}
        self._remember(t, buf, fresh)
        return buf, fresh

    def _remember(self, t: torch.Tensor, buf: Buffer, memo: dict[Any, Any]) -> None:
        entries = self._entries
        if len(entries) >= MAX_ENTRIES:
            entries.clear()
            self.kept = 0
        key = id(t)

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            found = entries.get(key)
            if found is not None and found[0] is ref:
                del entries[key]
                self.kept -= found[4].nbytes

        # the view keeps the storage, not the tensor: the reference dies with the tensor
        buf.original = None
        keep_storage_only(buf.array, t)
        entries[key] = (weakref.ref(t, forget), t.data_ptr(), t.shape, t.dtype, buf, memo)
        self.kept += buf.nbytes
