"""Unit checks behind issue 15's process tests: library frames in call sites, shapes in
call descriptions, and the new_group entry decoder (store bytes are untrusted)."""

from __future__ import annotations

import os

from rankwise.checks.groups import GroupEntry
from rankwise.identity.calls import describe_call
from rankwise.identity.callsite import CallSite, is_library
from rankwise.wire.frames import Op

TORCH = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages", "torch")
USER = os.path.join(os.sep, "home", "me", "train.py")


def test_library_frames_are_never_shown_first() -> None:
    site = CallSite(7, ((os.path.join(TORCH, "autograd", "graph.py"), 979, "_engine_run_backward"),
                        (os.path.join(TORCH, "_tensor.py"), 626, "backward"),
                        (USER, 30, "step"), (USER, 90, "main")))
    assert site.short == "train.py:30 in step"
    assert site.chain == ("train.py:30 in step <- train.py:90 in main (via _tensor.py:626 in "
                          "backward -> graph.py:979 in _engine_run_backward)")
    assert site.first == (USER, 30, "step")
    # the chain survives the wire (Kind.SITE / the shm segment)
    assert CallSite.decode(7, site.encode()).chain == site.chain


def test_all_library_site_still_names_a_frame() -> None:
    site = CallSite(1, ((os.path.join(TORCH, "nn", "parallel.py"), 5, "f"),))
    assert site.short == "parallel.py:5 in f"
    assert is_library(os.__file__) and not is_library(USER)


def test_shapes_shown_counts_compared() -> None:
    assert describe_call(Op.all_reduce, 0, 4, 0, 0, None, (2, 2)).startswith("all_reduce(")
    shaped = describe_call(Op.all_reduce, 1, 4, 0, 0, None, (2, 2))
    flat = describe_call(Op.all_reduce, 1, 4, 0, 0, None, (4,))
    assert "[2, 2]" in shaped and " x 4" in flat and " x 4" in describe_call(
        Op.all_reduce, 1, 4, 0, 0, None)


def test_group_entry_round_trip_and_hostile_bytes() -> None:
    entry = GroupEntry((0, 1), CallSite(3, ((USER, 12, "main"),)), "host|boot")
    back = GroupEntry.decode(entry.encode().encode())
    assert back.ranks == (0, 1) and back.host == "host|boot"
    assert back.call() == "new_group([0, 1]) at train.py:12 in main"
    for raw in (b"", b"[1, 2]", b'{"ranks": 5}', b'{"ranks": ["x"]}', b"\xff" * 10,
                b'{"ranks": [1], "site": 7}'):
        got = GroupEntry.decode(raw)
        assert isinstance(got.ranks, tuple)
