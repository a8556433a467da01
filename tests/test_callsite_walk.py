"""The call-site walk in C (``identity._frames``) and in Python give the same sites.

The C walk only looks up chains the Python walk has cached, so a wrong key in C would
show as a site of another line, or as a miss every time (the Python walk again)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import pytest

from rankwise.identity import callsite
from rankwise.identity.callsite import UNKNOWN, CallSite, capture

needs_c = pytest.mark.skipif(callsite._lookup is None,
                             reason="rankwise.identity._frames was not built (no compiler)")


def _here() -> CallSite:
    return capture(1)


def _there() -> CallSite:
    return capture(1)


def _deep(n: int) -> CallSite:
    return _deep(n - 1) if n else capture(1)


def _c_lookup(frame: FrameType) -> CallSite | None:
    assert callsite._lookup is not None
    return callsite._lookup(frame, callsite._kinds, callsite._cache, callsite._DEPTH,
                            callsite._VIA, UNKNOWN)


def test_each_line_keeps_its_own_site_whichever_walk_serves(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    c_walk = callsite._lookup
    sites = []
    for walk in (c_walk, c_walk, None, None):  # a loop: one line, so one chain, each time
        monkeypatch.setattr(callsite, "_lookup", walk)  # None: the pure-Python walk alone
        sites.append((_here(), _there()))
    assert all(a is sites[0][0] and b is sites[0][1] for a, b in sites)
    assert sites[0][0].id != sites[0][1].id
    assert [f[2] for f in sites[0][0].frames[:2]] == [
        "_here", "test_each_line_keeps_its_own_site_whichever_walk_serves"]


def test_a_deep_chain_keeps_four_user_frames_in_both_walks(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    c_walk = callsite._lookup
    sites = []
    for walk in (c_walk, c_walk, None):
        monkeypatch.setattr(callsite, "_lookup", walk)
        sites.append(_deep(6))
    assert sites[0] is sites[1] is sites[2]
    assert [f[2] for f in sites[0].frames] == ["_deep"] * 4


def _site_of_caller() -> CallSite | None:
    return capture(2)


def _c_site_of_caller() -> CallSite | None:
    return _c_lookup(sys._getframe(1))  # capture(2) counts its own frame


def _probe(which: Callable[[], CallSite | None]) -> CallSite | None:
    return which()  # one instruction for either: the same chain from here out


@needs_c
def test_the_c_walk_finds_the_cached_chain_and_misses_a_new_one() -> None:
    found = []
    for which in (_site_of_caller, _c_site_of_caller, _site_of_caller):
        found.append(_probe(which))
    assert found[0] is not None and found[0] is found[1] is found[2]
    assert [f[2] for f in found[0].frames[:2]] == [
        "_probe", "test_the_c_walk_finds_the_cached_chain_and_misses_a_new_one"]
    saved = dict(callsite._cache)
    callsite._cache.clear()
    callsite._clear()  # the C memo of chains found before goes with the cache
    try:
        assert _probe(_c_site_of_caller) is None  # not cached: the Python walk must run
    finally:
        callsite._cache.update(saved)


def _inner() -> CallSite:
    return capture(1)  # one line, reached from two outer lines below


def _outer_a() -> CallSite:
    return _inner()


def _outer_b() -> CallSite:
    return _inner()


@needs_c
def test_the_c_memo_tells_chains_apart_by_their_outer_frames() -> None:
    found = [(_outer_a(), _outer_b()) for _ in range(3)]  # seen, then from the memo
    a, b = found[0]
    assert a.id != b.id
    assert [f[2] for f in a.frames[:2]] == ["_inner", "_outer_a"]
    assert [f[2] for f in b.frames[:2]] == ["_inner", "_outer_b"]
    assert all(x is a and y is b for x, y in found)


def _three() -> tuple[CallSite, CallSite, CallSite]:
    return _outer_a(), _outer_b(), _here()  # one line: the same chains on every call


@needs_c
def test_after_forget_every_site_is_found_again_and_right() -> None:
    got = []
    for i in range(4):  # one line: the same chains each time
        if i == 1:
            callsite.forget()
            assert _probe(_c_site_of_caller) is None  # the memo went with the cache
        got.append(_three())  # then: the Python walk, the C walk, its memo
    before, after = got[0], got[1:]
    for again in after:
        assert [s.frames for s in again] == [s.frames for s in before]
        assert [s.id for s in again] == [s.id for s in before]
    assert all(x is y is z for x, y, z in zip(*after, strict=True))
