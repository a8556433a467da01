"""Rendezvous rounds: a multi-node job meets again, in a fresh namespace, before each restart.

Why: with ``--nnodes MIN:MAX --max-restarts N``, a lost node must not end the job while at
least MIN nodes remain (torchrun's elastic semantics). Every node whose attempt failed and
that still reaches the store joins round ``k`` (keys under ``rankwise/round<k>/``, so
nothing of the earlier round's nodes, beats or failures is seen); the round closes like the
first one (at MAX nodes, or MIN plus a few seconds' last call), and the ranks, the world
size and the node watch follow the new membership. Node 0 of the last round keeps rank 0
(it hosts the store); the others are numbered in arrival order.

Differences from torchrun: a node that arrives after the first round closed is refused
rather than parked until the next round; a node that cannot reach the store does not
restart (it is the one cut off) and ends with its own summary.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..store import PrefixStore
from ..store.base import Store
from .nodewatch import NodeWatch
from .rendezvous import NodeInfo, StorePeers, rendezvous

__all__ = ["Round", "join_round"]


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
               timeout: float) -> Round:
    """Meet the other nodes in round ``number`` (0: the job's first rendezvous).

    ``client(t)``: a fresh store client whose calls time out after ``t`` seconds (None: the
    job's rendezvous timeout). ``node_rank``: this node's wish (-1: any)."""
    def view(t: float | None) -> Store:
        store = client(t)
        return store if number == 0 else _RoundStore(f"rankwise/round{number}", store)

    store = view(None)
    try:
        me = NodeInfo(host=socket.gethostname(), pid=os.getpid(), nproc=nproc,
                      node_rank=node_rank, min_nodes=min_nodes, max_nodes=max_nodes,
                      rdzv_id=rdzv_id)
        assignment = rendezvous(store, me, timeout=timeout)
    finally:
        _close(store)
    # after the rendezvous, store calls are short: none may hold up the job's end
    short = min(timeout, 5.0)
    peers = StorePeers(view(short), lambda: view(short), assignment.node_rank)
    watch = NodeWatch(lambda: view(2.0), assignment.node_rank,
                      [n.host for n in assignment.nodes], nproc)
    return Round(number, assignment.node_rank, assignment.nnodes, peers, watch)


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()
