"""The NaN/Inf origin check (``checks.nan_check``) over thread-ranks: every rank raises,
naming the rank, before any rank's data changed; off, nothing is looked at."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import rankwise
from rankwise.checks import nan_check
from rankwise.testing.threads import ThreadRankError, run_threads


@pytest.fixture
def check_on() -> Iterator[None]:
    was = nan_check.on
    nan_check.set_on(True)
    try:
        yield
    finally:
        nan_check.set_on(was)


def _reduce_with_nan_on(bad_rank: int, value: float, op: str) -> Any:
    def rank_fn(rank: int, n: int) -> Any:
        x = np.arange(6, dtype=np.float32) + rank
        if rank == bad_rank:
            x[3] = value
        before = x.copy()
        try:
            if op == "reduce_scatter":
                out = np.zeros(2, np.float32)
                rankwise.reduce_scatter(out, [x[0:2], x[2:4], x[4:6]])
            elif op == "reduce":
                rankwise.reduce(x, dst=0)
            else:
                rankwise.all_reduce(x)
        except nan_check.NonFiniteInput as exc:
            assert np.array_equal(x, before, equal_nan=True)  # nothing moved
            rankwise.all_reduce(np.ones(1, np.float32))  # the group is still usable
            return exc
        return None

    return run_threads(rank_fn, 3, timeout=60)


@pytest.mark.parametrize("op", ["all_reduce", "reduce", "reduce_scatter"])
def test_every_rank_raises_naming_the_rank_before_data_moves(check_on: None, op: str) -> None:
    raised = _reduce_with_nan_on(1, float("nan"), op)
    for exc in raised:
        assert isinstance(exc, nan_check.NonFiniteInput), raised
        assert exc.ranks == [1]
        text = str(exc)
        assert "rank 1's input holds 1 NaN/Inf value(s) (the first at element 3)" in text
        assert f"non-finite input to {op}(float32 x 6) at test_nan_check.py:" in text


def test_an_inf_counts_too(check_on: None) -> None:
    raised = _reduce_with_nan_on(2, float("inf"), "all_reduce")
    assert all(isinstance(e, nan_check.NonFiniteInput) and e.ranks == [2] for e in raised)


def test_finite_inputs_reduce_as_usual(check_on: None) -> None:
    def rank_fn(rank: int, n: int) -> Any:
        x = np.full(4, rank, np.float32)
        rankwise.all_reduce(x)
        return x.tolist()

    assert run_threads(rank_fn, 3, timeout=60) == [[3.0] * 4] * 3


def test_off_a_nan_is_reduced_unseen() -> None:
    assert not nan_check.on  # the default

    def rank_fn(rank: int, n: int) -> bool:
        x = np.full(2, np.nan if rank == 0 else 1.0, np.float32)
        rankwise.all_reduce(x)
        return bool(np.isnan(x).all())

    assert run_threads(rank_fn, 2, timeout=60) == [True, True]


def test_scan_finds_the_first_bad_element_across_tensors() -> None:
    a, b = np.ones(3), np.array([1.0, np.inf, np.nan])
    assert nan_check._scan([a, b]) == (2, 4)
    assert nan_check._scan([np.array([1, 2], np.int64), a]) is None
    torch = pytest.importorskip("torch")
    t = torch.ones(5)
    t[2] = float("nan")
    assert nan_check._scan([torch.ones(2, dtype=torch.int64), t]) == (1, 4)


def test_steps_count_calls_outside_a_backward_pass() -> None:
    site = SimpleNamespace(id=123456789)
    nan_check._steps.pop(site.id, None)
    assert [nan_check._step(site) for _ in range(3)] == [1, 2, 3]


def test_steps_count_backward_passes_inside_one() -> None:
    torch = pytest.importorskip("torch")
    site = SimpleNamespace(id=987654321)
    nan_check._steps.pop(site.id, None)
    seen: list[int] = []
    w = torch.ones(2, requires_grad=True)
    w.register_hook(lambda g: seen.extend([nan_check._step(site), nan_check._step(site)]))
    for _ in range(3):
        (w * 2).sum().backward()
    assert seen == [1, 1, 2, 2, 3, 3]


def test_the_error_is_a_rankwise_error() -> None:
    assert issubclass(nan_check.NonFiniteInput, rankwise.DistError)
    with pytest.raises(ThreadRankError):  # a rank that raises is reported by the harness
        run_threads(lambda rank, n: 1 / 0, 1, timeout=10)
