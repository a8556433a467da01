"""Bucket assignment matches torch's C++ ``_compute_bucket_assignment_by_size``."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from rankwise.nn._buckets import assign_buckets, build_buckets

DTYPES = [torch.float32, torch.float64, torch.float16]


@pytest.mark.parametrize("seed", range(30))
def test_assignment_equals_torch(seed: int) -> None:
    rng = random.Random(seed)
    tensors = [
        torch.empty(rng.choice([1, 3, 64, 300, 5000]), dtype=rng.choice(DTYPES[: 1 + seed % 3]))
        for _ in range(rng.randint(1, 40))
    ]
    caps = [rng.choice([64, 1024, 4096]), rng.choice([256, 8192, 100_000])]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, caps)
    ours = assign_buckets([(t.numel() * t.element_size(), t.dtype) for t in tensors], caps)
    assert ours == [list(b) for b in theirs]


def test_views_alias_one_flat_buffer_in_the_given_order() -> None:
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(5, dtype=torch.float64)]
    buckets = build_buckets(params, order=[2, 1, 0], caps=[10**6])
    assert [b.params for b in buckets] == [[2], [1, 0]]
    floats = buckets[1]
    floats.views[1].fill_(7.0)
    assert floats.buffer.tolist() == [0.0] * 4 + [7.0] * 6
    assert floats.views[1].shape == (2, 3) and floats.pending == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_buckets_are_zeroed_aliased_and_keep_their_dtype(dtype: torch.dtype) -> None:
    # from 4 MiB a bucket's buffer comes from rankwise.wire.hugepages (numpy, huge pages)
    params = [torch.ones(1 << 20, dtype=dtype), torch.ones(3, 1 << 19, dtype=dtype)]
    (bucket,) = build_buckets(params, order=[0, 1], caps=[1 << 30])
    assert bucket.buffer.nbytes >= 4 << 20 and bucket.buffer.dtype == dtype
    assert not bucket.buffer.any()
    bucket.views[1].fill_(2.5)
    assert bucket.buffer[: 1 << 20].sum().item() == 0
    assert bucket.buffer[1 << 20:].float().sum().item() == 2.5 * 3 * (1 << 19)
    assert bucket.views[1].shape == params[1].shape
