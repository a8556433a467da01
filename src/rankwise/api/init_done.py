"""The last step of ``init_process_group``: no rank returns before every rank got there.

Why: a rank that returns from init can finish its program and exit while a peer is still
inside init, needing something only that rank gives -- the store it hosts (rank 0 without
a launcher), its answer in the engine agreement. The peer's init then failed ("rank 0
finished and exited ...") instead of the peer reporting its first call precisely (a p2p
tag mismatch, a missing collective). So every rank counts itself in (``init/done/<rank>``)
and waits, bounded by the init timeout, until all have; the rank hosting the store then
holds it until every rank has read that (else it could exit between another rank's
"all done" and that rank's reading it). A peer that fails or exits meanwhile ends the wait
with its failure: a failure the router hears at once (the store's watcher); a peer the
launcher saw end, found by rank 0 every half second (the others every 10 s, in case rank 0
is the one gone), which wakes the others through ``init/all``: O(N) store requests in all
however long the wait, not O(N) a second.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.communicator import Communicator
from ..errors import DistTimeout, PeerFailure
from ..store.seen import HOLD_LIMIT, count_seen_and_hold
from ..transport.mesh import exited_peers

__all__ = ["wait_all_initialized"]

_SLICE = 0.5  # seconds between rank 0's looks at peers that exited meanwhile
_SLICE_OTHERS = 10.0  # ... the other ranks' looks, when the store's watcher hears failures
_DONE = b"1"  # ``init/all`` when every rank got there; else why not


def wait_all_initialized(store: Any, comm: Communicator, timeout_s: float,
                         hosting: bool = False, held: bool = True) -> None:
    """Count this rank in and wait until every rank of ``comm`` finished init; then, when
    ``hosting`` the store, hold it until every rank has read that (``store.seen``).
    ``held``: whether a rank hosts the store (the rendezvous says); when none does (a
    launcher does), nobody holds it for the others, and counting in is a round trip
    (two for the last) that nobody reads."""
    rank, n = comm.rank, comm.world_size
    if n == 1:
        return
    _, done = store.batch([("set", f"init/done/{rank}", "1"), ("add", "init/done", 1)])
    # the last one in knows the verdict it sets: no read back
    if int(done) == n and store.compare_set("init/all", "", _DONE) == _DONE:
        if held or hosting:
            count_seen_and_hold(store, "init/seen", lambda: n, hosting,
                                min(HOLD_LIMIT, timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    others = [r for r in range(n) if r != rank]
    watched = callable(getattr(store, "watched", None)) and store.watched()
    slice_s = _SLICE if rank == 0 or not watched else _SLICE_OTHERS
    while True:
        remaining = deadline - time.monotonic()
        verdict = store.wait_get("init/all", max(0.05, min(slice_s, remaining)))  # one trip
        if verdict is not None:
            if verdict != _DONE:
                peer, _, how = verdict.decode("utf-8", "replace").partition(" ")
                raise _gone(rank, int(peer), how)
            if held or hosting:
                count_seen_and_hold(store, "init/seen", lambda: n, hosting,
                                    min(HOLD_LIMIT, timeout_s))
            return
        failure = comm.router.failure
        if failure is not None:
            raise comm.as_of_now(failure)
        gone = exited_peers(store, others)
        if gone:
            peer, how = min(gone.items())
            if store.compare_set("init/all", "", f"{peer} {how}") != _DONE:  # wakes the others
                raise _gone(rank, peer, how)
        if remaining <= 0:
            missing = [r for r in others if not store.check([f"init/done/{r}"])]
            raise DistTimeout(f"rank {rank}: ranks {missing} did not finish "
                              f"init_process_group within {timeout_s:g} s of this rank "
                              "(they are connected: a slow engine setup, or stopped?)")


def _gone(rank: int, peer: int, how: str) -> PeerFailure:
    return PeerFailure(f"rank {rank}: rank {peer} {how} before it finished init_process_group; "
                       "the job cannot go on without it", rank=peer)
