"""The pipelined all_reduce's chunk plan (``rankwise.engines.shm.chunks``): pure offsets.

What must hold for any count, dtype width, rank count and slot size: chunks tile the
buffer, every rank's chunk area fits its slot, parts tile each chunk on cache-line
boundaries, and a rank's own part (where its result goes) lies in the same bytes for
every chunk, so the next chunk's input never lands on the previous chunk's result.
"""

from __future__ import annotations

import itertools

import pytest

from rankwise.engines.shm.chunks import ALIGN, SKEW, padding, plan_chunks

SLOTS = [65536, 256 << 10, 1 << 20, 8 << 20]


@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
def test_plan_tiles_the_buffer_inside_the_slots(slot: int, nranks: int, itemsize: int) -> None:
    for count in (1, 17, slot // itemsize - 1, slot // itemsize + 1, 5 * slot // itemsize + 3):
        plan = plan_chunks(count, itemsize, nranks, slot)
        assert sum(plan.length(t) for t in range(plan.chunks)) == count
        assert all(plan.length(t) > 0 for t in range(plan.chunks))
        for t in range(plan.chunks):
            spans = [plan.span(t, j) for j in range(nranks)]
            assert spans[0][0] == 0 and spans[-1][1] == plan.length(t)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            for j, (lo, hi) in enumerate(spans):
                assert (lo * itemsize) % ALIGN == 0 or lo == plan.length(t)
                # own part: inside this rank's part of a full chunk, wherever t is
                assert lo == hi or plan.bounds[j][0] <= lo < hi <= plan.bounds[j][1]
        for r in range(nranks):
            assert plan.base[r] % ALIGN == 0
            assert plan.base[r] + plan.per_chunk * itemsize <= slot


def test_fewest_chunks_then_equal_ones() -> None:
    """A buffer just over one slot takes two half chunks, not a full one and a sliver;
    ranks' chunk areas are skewed so a part's inputs and result map to different
    cache sets."""
    slot, item = 1 << 20, 4
    plan = plan_chunks(slot // item + 1000, item, 4, slot)
    assert plan.chunks == 2
    assert abs(plan.length(0) - plan.length(1)) <= 64
    assert plan.base == (0, SKEW, 2 * SKEW, 3 * SKEW)
    assert plan_chunks(slot // item // 2, item, 4, slot).chunks == 1


@pytest.mark.parametrize("nranks", [2, 4, 8, 40])
def test_a_message_of_the_nominal_slot_size_is_one_chunk(nranks: int) -> None:
    slot = 1 << 20
    for itemsize in (1, 4, 8):
        assert plan_chunks(slot // itemsize, itemsize, nranks, slot + padding(nranks)).chunks == 1
    assert padding(1) == 0
