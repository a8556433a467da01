"""How a shared-memory wait spends its time (``rankwise.shmem.waiting``) and who wakes a
sleeper (``Channel.publish``): the policy's arithmetic without processes, and the wake
rule on a real segment with ranks as threads of this process (no rank runs concurrently:
each step is a direct call, so nothing here depends on timing)."""

from __future__ import annotations

from typing import Any

import pytest
from _transports import shm_thread_groups

from rankwise.engines.shm import channel as channel_mod
from rankwise.shmem.layout import H_WAKE, R_SLEEPING
from rankwise.shmem.waiting import Arrivals, policy_for


def test_arrivals_start_in_step() -> None:
    a = Arrivals(100e-6)
    assert not a.skewed and a.mean == 0.0


def test_long_first_waits_turn_the_skew_rule_on_and_short_ones_off() -> None:
    a = Arrivals(100e-6)
    a.saw(300e-6)  # one long wait is not a pattern
    assert not a.skewed
    for _ in range(6):
        a.saw(300e-6)
    assert a.skewed
    calls = 0
    while a.skewed:
        a.saw(0.0)  # peers already there: the ranks are back in step
        calls += 1
    assert 1 <= calls <= 12


def test_one_stretched_wait_counts_at_most_four_limits() -> None:
    """A wait stretched by a descheduled peer (20 ms under load) must not hold the rule on
    for hundreds of calls."""
    a = Arrivals(100e-6)
    a.saw(20e-3)
    assert a.mean == pytest.approx(Arrivals.WEIGHT * 400e-6)
    assert not a.skewed


def test_an_infinite_limit_never_turns_the_rule_on() -> None:
    a = Arrivals(float("inf"))
    for _ in range(50):
        a.saw(1.0)
    assert not a.skewed


def test_policy_skew_limit_follows_the_yield_budget_and_the_environment(
        monkeypatch: Any) -> None:
    from rankwise.shmem import waiting

    monkeypatch.setattr(waiting, "usable_cpus", lambda: 2)
    monkeypatch.delenv("RANKWISE_SHM_SKEW_US", raising=False)
    monkeypatch.setenv("RANKWISE_SHM_YIELD_US", "400")
    assert policy_for(4).skew_s == pytest.approx(100e-6)  # oversubscribed: on
    assert policy_for(2).skew_s == float("inf")  # a CPU per rank: off
    monkeypatch.setenv("RANKWISE_SHM_SKEW_US", "30")
    assert policy_for(2).skew_s == pytest.approx(30e-6)


def test_only_the_rank_that_completes_a_round_wakes_and_once_for_all(
        monkeypatch: Any) -> None:
    """Rank 0 and rank 1 'sleep' in round 1 (their flags up, as inside ``futex_wait``):
    rank 2 publishing leaves rank 3 missing, so waking them would only send them back to
    sleep; rank 3 completes the round and wakes both with one FUTEX_WAKE."""
    wakes: list[int] = []
    monkeypatch.setattr(channel_mod, "futex_wake", lambda addr, count=1 << 30: wakes.append(addr))
    gs = shm_thread_groups(4)
    try:
        chs = [g.ch for g in gs]
        w = chs[0].w
        lay = gs[0].seg.layout
        for r in (0, 1):
            assert chs[r].publish() == 1
            w[lay.record_word(r, R_SLEEPING)] = 1
        before = w[H_WAKE]
        chs[2].publish()
        assert wakes == [] and w[H_WAKE] == before
        chs[3].publish()
        assert len(wakes) == 1 and w[H_WAKE] != before
        for r in (0, 1):
            w[lay.record_word(r, R_SLEEPING)] = 0
        for ch in chs:  # the round is complete: no wait sleeps, or even polls
            ch.wait(1, float("inf"), lambda: "test", first=True)
        assert all(ch.sleeps == 0 for ch in chs)
    finally:
        for g in gs:
            g.close()


def test_a_round_completed_with_nobody_asleep_makes_no_system_call(monkeypatch: Any) -> None:
    wakes: list[int] = []
    monkeypatch.setattr(channel_mod, "futex_wake", lambda addr, count=1 << 30: wakes.append(addr))
    gs = shm_thread_groups(2)
    try:
        for g in gs:
            g.ch.publish()
        assert wakes == []
    finally:
        for g in gs:
            g.close()
