"""Goodbyes (core/departures.py): a rank that leaves after a peer's leaving failed its
wait names that peer, so a third rank that reads the second goodbye first still blames
the rank that left first (seen under load: the blame went to the wrong rank)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rankwise.core.departures import Departures
from rankwise.errors import PeerFailure


class _Router:
    def __init__(self) -> None:
        self.failed: list[tuple[int, BaseException]] = []

    def fail_peer(self, rank: int, exc: BaseException) -> None:
        self.failed.append((rank, exc))


def _departures(rank: int) -> tuple[Departures, _Router]:
    router = _Router()
    comm: Any = SimpleNamespace(rank=rank, world_size=3, router=router,
                                calls=SimpleNamespace(doing=lambda: "barrier() #2",
                                                call_of=lambda a: "barrier()"),
                                activity=SimpleNamespace(op="barrier"))
    return Departures(comm), router


def test_a_goodbye_after_a_peers_goodbye_names_the_first_to_leave() -> None:
    zero, _ = _departures(0)
    zero.on_bye(2, b"called destroy_process_group at t.py:9")
    (_, raised), = zero._comm.router.failed
    zero.as_of_now(raised)  # rank 0's wait raised it
    payload = zero._bye_payload("called destroy_process_group at <string>:1")

    one, router = _departures(1)
    one.on_bye(0, payload)  # rank 0's goodbye read before rank 2's
    (gone, exc), = router.failed
    assert gone == 0 and isinstance(exc, PeerFailure) and exc.rank == 2
    assert "rank 2 finished and called destroy_process_group at t.py:9" in str(exc)
    assert "passed on by rank 0" in str(exc)
    # re-phrased for a later wait, it still names rank 2 and the relay
    again = one.as_of_now(exc)
    assert getattr(again, "rank", None) == 2 and "passed on by rank 0" in str(again)


def test_plain_and_hostile_goodbyes_name_their_sender() -> None:
    for cause in (b"", b"\0not json", b'\0{"after": "x"}', b'\0{"after": 99, "where": 1}',
                  b'\0{"after": 1, "where": "me"}', b"\0[1]"):
        one, router = _departures(1)
        one.on_bye(2, b"called destroy_process_group at t.py:9" + cause)
        (gone, exc), = router.failed
        assert gone == 2 and getattr(exc, "rank", None) == 2, cause


def test_a_lost_peer_whose_calls_were_not_recorded_is_not_said_to_have_made_none() -> None:
    """An engine that moves data without frames (shared memory) records no peer's calls:
    after collectives ran, "Last collective seen: none" was wrong; say it was not recorded,
    with this rank's own last call."""
    failed: list[BaseException] = []
    recorded = ("Last collective seen from rank 2: not recorded (rank 0's last finished: "
                "all_reduce(float64 x 2, op=SUM) (#68 of WORLD))")
    for last_call, expected in (("all_reduce(float64 x 2, op=SUM) (#68 of WORLD)", recorded),
                                ("", "Last collective seen from rank 2: none")):
        router = SimpleNamespace(failure=None, fail_all=failed.append)
        comm: Any = SimpleNamespace(rank=0, world_size=3, router=router, closed=False,
                                    calls=SimpleNamespace(doing=lambda: ""),
                                    last_call=last_call, peer_call_sources=[],
                                    peer_sites={}, transport=None)
        Departures(comm).on_peer_lost(2, None)
        assert expected in str(failed[-1]), failed[-1]
