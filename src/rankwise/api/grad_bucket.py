"""``GradBucket``: what a DDP communication hook receives, as torch's ``dist.GradBucket``.

Torch-free (it only holds the caller's tensors), so ``rankwise.GradBucket`` resolves
without importing torch; ``rankwise.nn.DistributedDataParallel.register_comm_hook``
builds one per bucket per backward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GradBucket"]


class GradBucket:
    """One bucket of flattened gradients on its way to the other ranks.

    ``buffer()`` is the flat tensor; ``gradients()``/``parameters()`` are per-parameter
    views and their parameters; the hook returns a future whose value is the reduced
    flat tensor (not divided by the world size for it: that is the hook's job, as in
    torch).
    """

    def __init__(self, index: int, buffer: Any, gradients: list[Any], parameters: list[Any],
                 is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        return self._buffer

    def set_buffer(self, buffer: Any) -> None:
        self._buffer = buffer

    def gradients(self) -> list[Any]:
        return list(self._gradients)

    def parameters(self) -> list[Any]:
        return list(self._parameters)

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return f"<rankwise.GradBucket {self._index}{' (last)' if self._is_last else ''}>"
