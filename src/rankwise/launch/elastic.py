"""Rendezvous rounds: a multi-node job meets again, in a fresh namespace, before each restart.

Why: with ``--nnodes MIN:MAX --max-restarts N``, a lost node must not end the job while at
least MIN nodes remain (torchrun's elastic semantics). Every node whose attempt failed and
that still reaches the store joins round ``k`` (keys under ``rankwise/round<k>/``, so
nothing of the earlier round's nodes, beats or failures is seen); the round closes like the
first one (at MAX nodes, or MIN plus a few seconds' last call), and the ranks, the world
size and the node watch follow the new membership. Node 0 of the last round keeps rank 0
(it hosts the store); the others are numbered in arrival order.

A node that arrives after a round closed (or found it full) waits (``await_round``, bounded
by ``--timeout``) and joins the next round, the one the running nodes meet in at their next
restart, up to MAX nodes. Differences from torchrun: torchrun's running agents notice a
waiting node and restart a healthy group to admit it; rankwise admits it only when the job
restarts anyway (a failure or a lost node), so a healthy job is never interrupted, and a
waiting node whose job ends, or has no restart left, exits 0 saying it was not needed. A node
that cannot reach the store does not restart (it is the one cut off) and ends with its own
summary.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DistTimeout, RendezvousError
from ..store import PrefixStore
from ..store.base import Store
from .nodewatch import NodeWatch
from .rendezvous import PREFIX, NodeInfo, RendezvousClosed, StorePeers, rendezvous

__all__ = ["Round", "await_round", "close_rounds", "join_round"]


def _wake_key(number: int) -> str:
    """Set to ``open`` by the first node meeting in round ``number``, or to ``done`` when the
    job ends before it: what a node waiting for that round blocks on."""
    return f"{PREFIX}wake/{number}"


class _RoundStore(PrefixStore):
    """A round's namespace that closes its own client connection."""

    def close(self) -> None:
        close = getattr(self.underlying_store, "close", None)
        if callable(close):
            close()


@dataclass
class Round:
    """This node's place in one rendezvous round."""

    number: int
    node_rank: int
    nnodes: int
    peers: StorePeers
    watch: NodeWatch


def join_round(number: int, client: Callable[[float | None], Store], nproc: int,
               min_nodes: int, max_nodes: int, rdzv_id: str, node_rank: int,
               timeout: float, say: Callable[[str], None] | None = None) -> Round:
    """Meet the other nodes in round ``number`` (0: the job's first rendezvous).

    ``client(t)``: a fresh store client whose calls time out after ``t`` seconds (None: the
    job's rendezvous timeout). ``node_rank``: this node's wish (-1: any)."""
    def view(t: float | None) -> Store:
        store = client(t)
        return store if number == 0 else _RoundStore(f"rankwise/round{number}", store)

    store = view(None)
    try:
        if isinstance(store, _RoundStore):  # wakes the nodes waiting for this round
            store.underlying_store.compare_set(_wake_key(number), "", "open")
        me = NodeInfo(host=socket.gethostname(), pid=os.getpid(), nproc=nproc,
                      node_rank=node_rank, min_nodes=min_nodes, max_nodes=max_nodes,
                      rdzv_id=rdzv_id)
        assignment = rendezvous(store, me, timeout=timeout, say=say)
    except BaseException:
        _close(store)
        raise
    # after the rendezvous, store calls are short: none may hold up the job's end. The
    # same client goes on (a new one costs its connection's round trips on a slow link)
    short = min(timeout, 5.0)
    store.set_timeout(short)
    peers = StorePeers(store, lambda: view(short), assignment.node_rank)
    watch = NodeWatch(lambda: view(2.0), assignment.node_rank,
                      [n.host for n in assignment.nodes], nproc)
    return Round(number, assignment.node_rank, assignment.nnodes, peers, watch)


def await_round(client: Callable[[float | None], Store], nproc: int, min_nodes: int,
                max_nodes: int, rdzv_id: str, max_restarts: int, timeout: float,
                say: Callable[[str], None] | None = None) -> Round | None:
    """Wait (at most ``timeout`` s) for the job's next rendezvous round and join it; None
    when the job ended, or no round this node may still join is left, before that.

    Rounds 1..``max_restarts`` are tried in turn: a round that is closed or full when this
    node arrives sends it on to the next."""
    deadline = time.monotonic() + timeout
    for number in range(1, max_restarts + 1):
        left = deadline - time.monotonic()
        store = client(max(left, 0.1))
        try:
            state = store.get(_wake_key(number))
        except DistTimeout:
            raise RendezvousError(
                f"waited {timeout:g}s for the job's next rendezvous round (it opens when the "
                f"running nodes restart) and none opened; raise --timeout to wait longer"
            ) from None
        finally:
            _close(store)
        if state == b"done":
            return None
        try:
            return join_round(number, client, nproc, min_nodes, max_nodes, rdzv_id, -1,
                              max(left, 1.0), say)
        except RendezvousClosed:
            continue
    return None


def close_rounds(store: Store, current: int, max_restarts: int) -> None:
    """The job ended in round ``current``: nodes waiting for a later one stop waiting."""
    for number in range(current + 1, max_restarts + 1):
        store.compare_set(_wake_key(number), "", "done")


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()
