"""Gradient buckets: which parameters share one all_reduce, and their flat buffers.

One all_reduce per parameter would pay the per-message latency hundreds of times per
step; one all_reduce for the whole model could not start before the last gradient
exists. Buckets sit between the two. Parameters are visited in reverse registration
order, because backward produces the last layers' gradients first, and the first bucket
is small (torch uses 1 MiB) so that communication starts as early as possible.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..wire import hugepages

__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "assign_buckets", "build_buckets"]

FIRST_BUCKET_BYTES = 1024 * 1024
"""Cap of the first bucket, as torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``."""


def assign_buckets(sizes: Sequence[tuple[int, Hashable]], caps: Sequence[int]) -> list[list[int]]:
    """Group tensors into buckets, in the order given, like torch's assignment.

    ``sizes[i]`` is ``(nbytes, key)``; only tensors with equal keys (dtype) share a
    bucket. A bucket closes once it holds at least the current cap; each key walks
    through ``caps`` independently and stays on the last one. Buckets are returned
    ordered by their first tensor, so every rank derives the same launch order.
    """
    if not caps:
        raise ValueError("caps must not be empty")
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    cap_index: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for index, (nbytes, key) in enumerate(sizes):
        members, total = open_buckets.get(key, ([], 0))
        members.append(index)
        total += nbytes
        level = cap_index.get(key, 0)
        if total >= caps[level]:
            done.append(members)
            open_buckets.pop(key, None)
            cap_index[key] = min(level + 1, len(caps) - 1)
        else:
            open_buckets[key] = (members, total)
    done.extend(members for members, _ in open_buckets.values())
    done.sort(key=lambda members: members[0])
    return done


@dataclass
class Bucket:
    """Parameters reduced together, and one contiguous buffer holding their gradients.

    ``views[k]`` is shaped like parameter ``params[k]`` and aliases ``buffer``; filling
    the views fills the buffer that goes on the wire, so there is no separate flatten.
    """

    index: int
    params: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0
    work: Any = field(default=None, repr=False)

    def reset(self) -> None:
        """Prepare for the next iteration: every parameter's gradient is awaited again."""
        self.pending = len(self.params)
        self.work = None


def build_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]
) -> list[Bucket]:
    """Allocate buckets for ``params`` visited in ``order`` (indices into ``params``)."""
    sizes = [(params[i].numel() * params[i].element_size(), params[i].dtype) for i in order]
    buckets: list[Bucket] = []
    for bucket_index, positions in enumerate(assign_buckets(sizes, caps)):
        members = [order[p] for p in positions]
        first = params[members[0]]
        buffer = _zeros(sum(params[i].numel() for i in members), first)
        views: list[torch.Tensor] = []
        offset = 0
        for i in members:
            n = params[i].numel()
            views.append(buffer[offset : offset + n].view(params[i].shape))
            offset += n
        bucket = Bucket(bucket_index, members, buffer, views)
        bucket.reset()
        buckets.append(bucket)
    return buckets


def _zeros(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A zeroed flat buffer for ``numel`` elements of ``like``'s dtype and device. On the
    CPU a large one sits on huge pages: every step all-reduces it, and the kernel copies
    it in and out of sockets faster (see ``rankwise.wire.hugepages``)."""
    nbytes = numel * like.element_size()
    if like.device.type != "cpu" or nbytes < hugepages.MIN_BYTES:
        return torch.zeros(numel, dtype=like.dtype, device=like.device)
    return torch.from_numpy(hugepages.empty(nbytes)).view(like.dtype).zero_()
