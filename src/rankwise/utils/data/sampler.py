"""``DistributedSampler``: the shard of a dataset one rank iterates.

The index sequence is exactly torch's, so a job can switch between rankwise and
torch.distributed (or resume a torch run) and every rank still sees the same samples:
shuffle with a ``torch.Generator`` seeded ``seed + epoch``, pad by repeating the head of
the permutation (or drop the tail with ``drop_last``), then take every
``num_replicas``-th index starting at ``rank``.

The class derives from ``torch.utils.data.DistributedSampler`` (so ``isinstance`` checks
in training loops and libraries pass) without running its ``__init__``, which would ask
``torch.distributed`` for the rank; it sets the same attributes and overrides every
method torch's class defines (``__iter__``, ``__len__``, ``set_epoch``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from rankwise.errors import InvalidArgument
from rankwise.nn._comm import comm

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchDistributedSampler[int]):
    """Restricts data loading to a subset of the dataset, one disjoint subset per rank.

    ``num_replicas`` and ``rank`` default to the default process group's world size and
    rank. Call :meth:`set_epoch` at the start of every epoch when shuffling, or every
    epoch repeats the same order. Without ``drop_last`` every rank gets the same number
    of samples (padded); with it, the tail that cannot be split evenly is dropped.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            dist = _initialized_comm()
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        assert num_replicas is not None and rank is not None
        if num_replicas < 1:
            raise InvalidArgument(f"num_replicas must be at least 1, got {num_replicas}")
        if rank >= num_replicas or rank < 0:
            raise InvalidArgument(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset  # type: ignore[assignment]  # torch says Dataset; any Sized works
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        size = len(dataset)
        if drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        size = len(cast(Sized, self.dataset))
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices: list[int] = torch.randperm(size, generator=generator).tolist()
        else:
            indices = list(range(size))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif indices:
            padding = self.total_size - len(indices)
            repeats = math.ceil(padding / len(indices)) if padding else 0
            indices += (indices * repeats)[:padding]
        assert len(indices) == self.total_size
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: all ranks must pass the same value to stay disjoint."""
        self.epoch = epoch


def _initialized_comm() -> Any:
    dist = comm()
    if not dist.is_initialized():
        raise InvalidArgument(
            "DistributedSampler needs num_replicas and rank, or an initialised default "
            "process group to take them from: call init_process_group() first."
        )
    return dist
