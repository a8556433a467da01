"""Unit checks behind issue 15's process tests: library frames in call sites, shapes in
call descriptions, the new_group entry decoder (store bytes are untrusted), and the store
host keeping its store up until every rank has read a group-order mismatch."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest

from rankwise.checks.groups import GroupEntry, agree_on_group
from rankwise.errors import CollectiveMismatch, DistError
from rankwise.identity.calls import describe_call
from rankwise.identity.callsite import CallSite, is_library
from rankwise.store import TCPStore
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


class _LatePeer:
    """A peer store client that reads the group entries only after the host has either
    counted itself in (it holds the store then) or shut its store down (the race: a
    host that raises first and exits took the store with it, and this peer reported
    "the store went away" instead of the mismatch)."""

    def __init__(self, client: TCPStore) -> None:
        self._client = client
        self._waited = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def get(self, key: str) -> bytes:
        if not self._waited:
            self._waited = True
            try:
                self._client.wait(["new_group/1/seen"], timedelta(seconds=10))
            except DistError:
                pass  # the store is gone: the get below shows it
        return self._client.get(key)


def test_store_host_holds_its_store_until_every_rank_read_a_group_mismatch() -> None:
    host = TCPStore("127.0.0.1", 0, is_master=True, world_size=None)
    peer = _LatePeer(TCPStore("127.0.0.1", host.port, is_master=False))
    errors: dict[str, BaseException] = {}

    def run_host() -> None:
        try:
            agree_on_group(host, 1, GroupEntry((0, 1), CallSite(0, ()), "h"), 0, 2, 10.0,
                           hosting=True)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors["host"] = exc
        finally:
            host.close()  # what the host's exit does to its store

    thread = threading.Thread(target=run_host, daemon=True)
    thread.start()
    try:
        with pytest.raises(CollectiveMismatch, match="new_group order mismatch"):
            agree_on_group(peer, 1, GroupEntry((2, 3), CallSite(0, ()), "h"), 1, 2, 10.0)
    finally:
        thread.join(15.0)
        peer.close()
    assert isinstance(errors.get("host"), CollectiveMismatch)
