"""The call-site walk in C (``rankwise._native``) and in Python give the same sites.

The C walk only looks up chains the Python walk has cached, so a wrong key in C would
show as a site of another line, or as a miss every time (the Python walk again)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from rankwise.identity import callsite
from rankwise.identity.callsite import UNKNOWN, CallSite, capture

needs_c = pytest.mark.skipif(callsite._lookup is None,
                             reason="rankwise._native was not built (no compiler)")


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
    try:
        assert _probe(_c_site_of_caller) is None  # not cached: the Python walk must run
    finally:
        callsite._cache.update(saved)


@needs_c
def test_the_c_walk_leaves_an_unclassified_file_to_python() -> None:
    frame = sys._getframe(0)
    saved = dict(callsite._kinds)
    callsite._kinds.clear()
    try:
        assert _c_lookup(frame) is None
    finally:
        callsite._kinds.update(saved)


# The C walk's memo (``_native.c``): a table of chains the cache dict answered before, keyed
# by code pointers and instruction offsets. Each test runs under both walks; under C it
# checks the C lookup answered (a wrong memo gives a site, never a miss) and that each
# answer is the dict's own site for its chain.

@pytest.fixture(params=["c", "python"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[CallSite]:
    """The C lookup's answers (empty under the Python walk)."""
    served: list[CallSite] = []
    c_lookup = callsite._lookup
    if request.param == "python":
        monkeypatch.setattr(callsite, "_lookup", None)
        return served
    if c_lookup is None:
        pytest.skip("rankwise._native was not built (no compiler)")

    def counting(*args: object) -> CallSite | None:
        site = c_lookup(*args)  # type: ignore[arg-type]
        if site is not None:
            served.append(site)
        return site

    monkeypatch.setattr(callsite, "_lookup", counting)
    return served


def _in_cache(site: CallSite) -> bool:
    return any(s is site for s in callsite._cache.values())


def _two_lines() -> tuple[CallSite, CallSite, int]:
    line = sys._getframe().f_lineno
    a = capture(1)
    b = capture(1)
    return a, b, line


def test_two_lines_of_one_function_keep_two_sites(walk: list[CallSite]) -> None:
    got = [_two_lines() for _ in range(4)]
    a, b, line = got[0]
    assert all(x is a and y is b for x, y, _ in got)
    assert (a.frames[0][1], b.frames[0][1]) == (line + 1, line + 2)
    assert _in_cache(a) and _in_cache(b)
    if callsite._lookup is not None:  # the C walk: it answered
        assert sum(s is a for s in walk) >= 2 and sum(s is b for s in walk) >= 2


def _leaf() -> CallSite:
    return capture(1)


def _mid(n: int) -> CallSite:
    return _mid(n - 1) if n else _leaf()


def _top(which: int, n: int) -> CallSite:
    if which:
        return _mid(n)
    return _mid(n)


def test_the_same_innermost_line_under_other_callers_keeps_its_own_site(
        walk: list[CallSite]) -> None:
    # n=1: _leaf, _mid, _mid, _top: the 4th (last kept) frame differs; n=2: _top is 5th,
    # beyond the walk's depth, so both chains are the same
    near = [(_top(0, 1), _top(1, 1)) for _ in range(3)]
    far = [(_top(0, 2), _top(1, 2)) for _ in range(3)]
    a, b = near[0]
    assert all(x is a and y is b for x, y in near)
    assert a is not b and a.frames[:3] == b.frames[:3] and a.frames[3][1] != b.frames[3][1]
    assert [f[2] for f in a.frames] == ["_leaf", "_mid", "_mid", "_top"]
    assert all(x is far[0][0] and y is far[0][0] for x, y in far)
    assert [f[2] for f in far[0][0].frames] == ["_leaf", "_mid", "_mid", "_mid"]
    assert all(_in_cache(s) for s in (a, b, far[0][0]))
    if callsite._lookup is not None:  # the C walk: it answered
        assert {id(s) for s in walk} == {id(a), id(b), id(far[0][0])}


def _before_and_after(clear: Callable[[], None]) -> tuple[list[CallSite], list[CallSite]]:
    """Three captures, ``clear()``, three more: all from the same chain of lines."""
    got = []
    for step in (None, clear):
        if step is not None:
            step()
        got.append([_leaf() for _ in range(3)])
    return got[0], got[1]


def test_a_cleared_cache_is_never_answered_from_memory(walk: list[CallSite]) -> None:
    first, again = _before_and_after(callsite._cache.clear)
    assert first[0] is first[1] is first[2]
    assert again[0] is not first[0] and again[0].frames == first[0].frames
    assert again[0] is again[1] is again[2] and _in_cache(again[0])


def test_skip_directory_forgets_the_remembered_sites(walk: list[CallSite], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # a cache of one site, cleared and filled again to the same size before the C lookup
    # runs again: only skip_directory's explicit clear of the memo tells it
    monkeypatch.setattr(callsite, "_cache", {})
    monkeypatch.setattr(callsite, "_kinds", {})
    monkeypatch.setattr(callsite, "_skip_dirs", callsite._skip_dirs)
    first, again = _before_and_after(lambda: callsite.skip_directory(str(tmp_path)))
    assert first[0] is first[1] is first[2]
    assert again[0] is not first[0] and again[0].frames == first[0].frames
    assert again[0] is again[1] is again[2] and list(callsite._cache.values()) == [again[0]]


def test_more_sites_than_the_memo_holds_each_keep_their_own(walk: list[CallSite],
                                                            tmp_path: Path) -> None:
    # 1500 lines, one capture each: more chains than the memo's 1024 entries, so sets fill
    # and evict (a reference dropped twice would crash here, a wrong compare mix lines)
    n = 1500
    source = "def many(capture):\n    out = []\n" + "".join(
        "    out.append(capture(1))\n" for _ in range(n)) + "    return out\n"
    (tmp_path / "many.py").write_text(source)
    spec = importlib.util.spec_from_file_location("_many_call_sites", tmp_path / "many.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rounds = [module.many(capture) for _ in range(3)]
    assert [s.frames[0][1] for s in rounds[0]] == list(range(3, 3 + n))
    assert all(x is y is z for x, y, z in zip(*rounds, strict=True))
    assert all(_in_cache(s) for s in rounds[0])
    if callsite._lookup is not None:  # the C walk: it answered
        assert len(walk) >= n
