"""Passing failures on when connections are opened on demand (core/departures.py).

Over a full mesh every rank hears a failure itself; with connections on demand only the
ranks connected to the failed one do, so the first failure a rank learns of is passed on
to its own audience, once. Not by a rank that is leaving: a peer that heard our goodbye
skips its own to us, so its close is no news (passing it on failed the ranks still in
their last collective: seen at 64 ranks).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from rankwise.core.departures import Departures
from rankwise.errors import PeerFailure


class _Router:
    def __init__(self) -> None:
        self.failure: BaseException | None = None

    def fail_all(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc


def _departures(passes_on: bool) -> tuple[Departures, list[dict[str, Any]]]:
    comm: Any = SimpleNamespace(rank=1, world_size=4, closed=False, router=_Router(),
                                transport=SimpleNamespace(passes_on=lambda: passes_on),
                                calls=SimpleNamespace(doing=lambda: "barrier() #2"),
                                peer_call_sources=[], last_call=None)
    dep = Departures(comm)
    sent: list[dict[str, Any]] = []
    dep.broadcast_abort = (  # type: ignore[method-assign]
        lambda info, background=False, timeout=2.0: sent.append(info))
    return dep, sent


def test_a_lost_peer_is_passed_on_once_when_not_every_rank_is_connected() -> None:
    dep, sent = _departures(passes_on=True)
    dep.on_peer_lost(3, None)
    dep.on_peer_lost(2, None)  # a second failure: not passed on again
    (info,) = sent
    assert info["rank"] == 3 and info["relayed_by"] == 1 and "rank 3 died" in info["message"]
    assert isinstance(dep._comm.router.failure, PeerFailure)


def test_over_a_full_mesh_nothing_is_passed_on() -> None:
    dep, sent = _departures(passes_on=False)
    dep.on_peer_lost(3, None)
    dep.on_abort(2, json.dumps({"kind": "exception", "rank": 2, "message": "boom"}).encode())
    assert not sent and dep._comm.router.failure is not None


def test_an_abort_is_passed_on_as_it_came() -> None:
    dep, sent = _departures(passes_on=True)
    abort = {"kind": "exception", "rank": 2, "message": "ValueError: boom"}
    dep.on_abort(0, json.dumps(abort).encode())
    dep.on_abort(3, json.dumps(abort).encode())  # heard twice: passed on once
    assert sent == [abort]


def test_a_leaving_rank_does_not_pass_on_a_peers_close() -> None:
    dep, sent = _departures(passes_on=True)
    dep.leaving = True
    dep.on_peer_lost(3, None)
    assert not sent
