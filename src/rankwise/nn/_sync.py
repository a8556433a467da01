"""Construction-time agreement: same parameters everywhere, then rank 0's values.

DDP averages gradients slot by slot, so ranks holding different models would silently
mix unrelated numbers (or hang, when the bucket sizes differ). One all_gather_object of
a compact signature catches that before any training step, on every rank at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rankwise.nn._comm import comm
from rankwise.nn._errors import ParameterMismatch

__all__ = ["Signature", "agree_on_parameters", "broadcast_tensors", "signature_of"]

Signature = list[tuple[str, tuple[int, ...], str]]
"""``(name, shape, dtype)`` of each parameter DDP manages, in registration order."""

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def signature_of(named: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    """The signature of the given named tensors."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]


def _describe(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "no parameter"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"


def _first_difference(signatures: Sequence[Signature], ranks: Sequence[int]) -> str | None:
    """Describe the first slot where some rank's signature differs from the first rank's."""
    reference = signatures[0]
    longest = max(len(s) for s in signatures)
    for slot in range(longest):
        mine = reference[slot] if slot < len(reference) else None
        for rank, sig in zip(ranks[1:], signatures[1:], strict=True):
            theirs = sig[slot] if slot < len(sig) else None
            if theirs != mine:
                return (
                    f"parameter #{slot}: rank {ranks[0]} has {_describe(mine)}, "
                    f"rank {rank} has {_describe(theirs)}"
                )
    return None


def agree_on_parameters(signature: Signature, group: Any) -> list[int]:
    """Check every rank of ``group`` has the same signature; return the group's global ranks.

    The global ranks come along in the same gather (they are needed to name rank 0 of a
    subgroup as broadcast source), so the check costs one collective. Raises
    :class:`ParameterMismatch` on every rank, naming the first differing parameter.
    """
    dist = comm()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dist.get_rank(), signature), group=group)
    ranks = [rank for rank, _ in gathered]
    difference = _first_difference([sig for _, sig in gathered], ranks)
    if difference is not None:
        raise ParameterMismatch(
            "DistributedDataParallel needs the same model on every rank, but "
            f"{difference}. Build the model identically on every rank (same code, same "
            "constructor arguments) before wrapping it."
        )
    return ranks


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Overwrite ``tensors`` in place with ``src``'s values, coalesced per dtype.

    Flattening many small tensors into a few large messages avoids paying one round of
    latency per tensor, which dominates for models with many small biases and norms.
    """
    dist = comm()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            for chunk in _chunks(same_dtype):
                flat = torch.cat([t.reshape(-1) for t in chunk])
                dist.broadcast(flat, src=src, group=group)
                offset = 0
                for t in chunk:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        chunk.append(t)
        size += t.numel() * t.element_size()
        if size >= _BROADCAST_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
