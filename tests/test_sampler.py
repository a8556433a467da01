"""DistributedSampler yields exactly torch's indices, for every configuration we can think of."""

from __future__ import annotations

import itertools

import pytest
import torch.utils.data as tud

from rankwise.utils.data import DistributedSampler

SIZES = [0, 1, 2, 3, 7, 10, 16, 17, 101]
REPLICAS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product([True, False], repeat=2)))
def test_indices_equal_torch(shuffle: bool, drop_last: bool) -> None:
    for size, replicas, seed, epoch in itertools.product(SIZES, REPLICAS, [0, 7], [0, 3]):
        data = range(size)
        for rank in range(replicas):
            kwargs = {
                "num_replicas": replicas,
                "rank": rank,
                "shuffle": shuffle,
                "seed": seed,
                "drop_last": drop_last,
            }
            ours = DistributedSampler(data, **kwargs)  # type: ignore[arg-type]
            theirs = tud.DistributedSampler(data, **kwargs)  # type: ignore[arg-type]
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            case = (size, replicas, rank, seed, epoch)
            assert list(ours) == list(theirs), case
            assert len(ours) == len(theirs) == len(list(ours)), case


def test_shards_cover_dataset_and_epochs_differ() -> None:
    shards = [DistributedSampler(range(10), num_replicas=3, rank=r) for r in range(3)]
    first = [list(s) for s in shards]
    assert set(itertools.chain.from_iterable(first)) == set(range(10))
    assert all(len(shard) == 4 for shard in first)  # 10 padded to 12
    for s in shards:
        s.set_epoch(1)
    assert [list(s) for s in shards] != first


def test_works_in_a_dataloader() -> None:
    sampler = DistributedSampler(list(range(12)), num_replicas=2, rank=1, shuffle=False)
    loader = tud.DataLoader(list(range(12)), batch_size=4, sampler=sampler)
    assert [b.tolist() for b in loader] == [[1, 3, 5, 7], [9, 11]]


@pytest.mark.parametrize("replicas,rank", [(0, 0), (2, -1), (2, 2)])
def test_bad_rank_or_replicas(replicas: int, rank: int) -> None:
    with pytest.raises(ValueError):
        DistributedSampler(range(4), num_replicas=replicas, rank=rank)
