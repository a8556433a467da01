"""Collectives over the in-memory transport, ranks as threads: the fast harness.

These run the real API, router, fingerprint checks and algorithms, with no sockets, in
milliseconds: the place to test an algorithm change first.
"""

from __future__ import annotations

import numpy as np
import pytest

import rankwise as rw
from rankwise.errors import CollectiveMismatch
from rankwise.testing.threads import ThreadRankError, run_threads


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count", [1, 7, 1000, 300_000])
def test_all_reduce_sum_matches_numpy(n: int, count: int) -> None:
    def body(rank: int, size: int) -> np.ndarray:
        t = np.arange(count, dtype=np.float64) * (rank + 1)
        rw.all_reduce(t)
        return t

    expected = np.arange(count, dtype=np.float64) * sum(range(1, n + 1))
    for got in run_threads(body, n):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_once(n: int) -> None:
    def body(rank: int, size: int) -> dict[str, object]:
        out: dict[str, object] = {}
        t = np.full(3, rank, np.int64)
        rw.broadcast(t, src=size - 1)
        out["broadcast"] = t.tolist()
        r = np.full(2, rank + 1, np.int32)
        rw.reduce(r, dst=0, op=rw.ReduceOp.MAX)
        out["reduce"] = r.tolist() if rank == 0 else None
        parts = [np.zeros(2, np.float32) for _ in range(size)]
        rw.all_gather(parts, np.full(2, rank, np.float32))
        out["all_gather"] = [p.tolist() for p in parts]
        got = np.zeros(1, np.int64)
        rw.scatter(got, [np.array([10 * i]) for i in range(size)] if rank == 0 else None, src=0)
        out["scatter"] = int(got[0])
        rs = np.zeros(1, np.int64)
        rw.reduce_scatter(rs, [np.array([rank * 100 + i]) for i in range(size)])
        out["reduce_scatter"] = int(rs[0])
        a2a = [np.zeros(1, np.int64) for _ in range(size)]
        rw.all_to_all(a2a, [np.array([rank * 10 + i]) for i in range(size)])
        out["all_to_all"] = [int(x[0]) for x in a2a]
        objs: list[object] = [None] * size
        rw.all_gather_object(objs, {"rank": rank})
        out["objects"] = objs
        rw.barrier()
        return out

    for rank, out in enumerate(run_threads(body, n)):
        assert out["broadcast"] == [n - 1] * 3
        if rank == 0:
            assert out["reduce"] == [n, n]
        assert out["all_gather"] == [[float(i)] * 2 for i in range(n)]
        assert out["scatter"] == 10 * rank
        assert out["reduce_scatter"] == sum(r * 100 + rank for r in range(n))
        assert out["all_to_all"] == [i * 10 + rank for i in range(n)]
        assert out["objects"] == [{"rank": i} for i in range(n)]


def test_a_count_mismatch_raises_collective_mismatch() -> None:
    def body(rank: int, size: int) -> None:
        rw.all_reduce(np.ones(4 if rank == 0 else 5, np.float32))

    with pytest.raises(ThreadRankError) as info:
        run_threads(body, 2)
    assert all(isinstance(e, CollectiveMismatch) for e in info.value.errors.values())
    assert "all_reduce(float32 x 4" in str(info.value)


def test_a_raising_rank_is_named_and_nothing_hangs() -> None:
    def body(rank: int, size: int) -> None:
        if rank == 1:
            raise ValueError("boom")
        rw.barrier()

    with pytest.raises(ThreadRankError) as info:
        run_threads(body, 3, timeout=15)
    assert isinstance(info.value.errors[1], ValueError)
    assert set(info.value.errors) == {0, 1, 2}
