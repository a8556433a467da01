"""Let the launchers of several nodes agree on one job through the store.

Why in the store and not in the workers: the launcher of node 0 hosts the store, so the
rendezvous outlives any worker (rank 0's crash does not take it down), and the launchers learn
their node ranks and the world size *before* starting a single worker.

Protocol, all keys under ``rankwise/rdzv/``::

    job             first node's settings (rdzv id, nproc, nnodes) -- compare_set; a node whose
                    settings differ is refused with both nodes named
    rank/<r>        who claimed an explicit --node-rank r -- compare_set; a duplicate is refused
    joined          arrival counter (add); arrival k writes node/<k> = its NodeInfo
    closed          final node count; set by the arrival that completes the job (or, for
                    --nnodes MIN:MAX, by the MIN-th arrival after ``last_call`` seconds)
    r<a>/failed     first node whose rank failed in attempt a (compare_set)
    r<a>/failure/<n> that node's failed worker (JSON), for the other nodes' summaries
    end/<n>         node n is done; the hosting node keeps the store up until all are

Node ranks: explicit ones as given; the others fill the free ranks in arrival order.  Every
node computes the same assignment from the same ``node/<k>`` records, so no leader is needed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..errors import DistError, DistTimeout, RendezvousError
from ..store.base import Store
from .summary import WorkerOutcome, cause_line

__all__ = ["Assignment", "NodeInfo", "RendezvousClosed", "StorePeers", "rendezvous"]

PREFIX = "rankwise/rdzv/"
PROGRESS_EVERY = 30.0  #: seconds between a waiting launcher's progress lines


class RendezvousClosed(RendezvousError):
    """The round this node came to join is closed or full: with ``--nnodes MIN:MAX`` it may
    wait for the job's next round (``elastic.await_round``)."""


@dataclass(frozen=True)
class NodeInfo:
    """One launcher's identity and settings, as published to the others."""

    host: str
    pid: int
    nproc: int
    node_rank: int  # -1: not given, assign one
    min_nodes: int
    max_nodes: int
    rdzv_id: str

    def describe(self) -> str:
        rank = f"--node-rank {self.node_rank}" if self.node_rank >= 0 else "no --node-rank"
        nnodes = str(self.max_nodes) if self.min_nodes == self.max_nodes else \
            f"{self.min_nodes}:{self.max_nodes}"
        return (f"node on {self.host} (launcher pid {self.pid}; --nproc-per-node {self.nproc}, "
                f"--nnodes {nnodes}, --rdzv-id {self.rdzv_id!r}, {rank})")

    def settings(self) -> tuple[str, int, int, int]:
        return (self.rdzv_id, self.nproc, self.min_nodes, self.max_nodes)

    @classmethod
    def loads(cls, raw: bytes) -> NodeInfo:
        return cls(**json.loads(raw.decode()))

    def dumps(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class Assignment:
    """The outcome of the rendezvous for this node."""

    node_rank: int
    nnodes: int
    nodes: tuple[NodeInfo, ...]  # indexed by node rank


def _key(name: str) -> str:
    return PREFIX + name


def _refuse_mismatch(me: NodeInfo, first: NodeInfo) -> None:
    names = ("rdzv id", "nproc-per-node", "min nodes", "max nodes")
    diffs = [f"{n}: {a!r} here vs {b!r} there"
             for n, a, b in zip(names, me.settings(), first.settings(), strict=True) if a != b]
    raise RendezvousError(
        f"refusing to join: this {me.describe()} does not match the job started by the "
        f"{first.describe()} ({'; '.join(diffs)}). Start every node's launcher with the same "
        f"--nproc-per-node, --nnodes and --rdzv-id."
    )


def assign_ranks(infos: list[NodeInfo]) -> list[int]:
    """Node rank of each arrival: explicit ranks kept, the rest fill gaps in arrival order."""
    n = len(infos)
    taken: dict[int, NodeInfo] = {}
    for info in infos:
        if info.node_rank < 0:
            continue
        if info.node_rank >= n:
            raise RendezvousError(
                f"the {info.describe()} asked for node rank {info.node_rank}, but the job has "
                f"only {n} nodes (ranks 0..{n - 1})"
            )
        if info.node_rank in taken:
            raise RendezvousError(
                f"duplicate node rank {info.node_rank}: claimed by the {taken[info.node_rank].describe()} "
                f"and by the {info.describe()}"
            )
        taken[info.node_rank] = info
    free = iter(r for r in range(n) if r not in taken)
    return [info.node_rank if info.node_rank >= 0 else next(free) for info in infos]


def rendezvous(store: Store, me: NodeInfo, timeout: float, last_call: float = 3.0,
               say: Callable[[str], None] | None = None) -> Assignment:
    """Join the job described by ``me``; block (bounded by ``timeout``) until it is complete.
    ``say`` is told, after a second of waiting and then every ``PROGRESS_EVERY`` seconds,
    who is here, who is missing and when the wait ends.

    Raises ``RendezvousError`` naming both nodes on mismatched settings or a duplicate node
    rank, or when the job is already full or closed.
    """
    first_raw = store.compare_set(_key("job"), "", me.dumps())
    first = NodeInfo.loads(first_raw)
    if first.settings() != me.settings():
        _refuse_mismatch(me, first)
    # each batch is one round trip (a slow link pays per round trip, docs/heartbeats.md)
    claim = [("compare_set", _key(f"rank/{me.node_rank}"), "", me.dumps())] \
        if me.node_rank >= 0 else []
    *held, closed = store.batch([*claim, ("read", _key("closed"))])
    if held and held[0] != me.dumps().encode():
        raise RendezvousError(
            f"duplicate node rank {me.node_rank}: already claimed by the "
            f"{NodeInfo.loads(held[0]).describe()}; refusing this {me.describe()}. Give each "
            f"node a distinct --node-rank, or leave it out to have one assigned."
        )
    if closed is not None:
        raise RendezvousClosed(
            f"refusing this {me.describe()}: the job already closed its rendezvous with "
            f"{int(closed)} nodes"
        )
    arrival = store.add(_key("joined"), 1)
    if arrival > me.max_nodes:
        raise RendezvousClosed(
            f"refusing this {me.describe()}: the job already has its {me.max_nodes} nodes"
        )
    last = [("compare_set", _key("closed"), "", str(arrival))] if arrival == me.max_nodes \
        else []
    publish = [("set", _key(f"node/{arrival}"), me.dumps()), *last]
    closed_b: bytes | None = None
    if not last and arrival >= me.min_nodes and arrival == me.min_nodes:
        store.batch(publish)
        try:
            store.wait([_key("closed")], timeout=last_call)
        except DistTimeout:
            store.compare_set(_key("closed"), "", str(store.add(_key("joined"), 0)))
    else:  # this node's entry out and the first look at "closed" in one round trip
        _, closed_b = store.batch_then_wait_get(publish, _key("closed"),
                                                min(_QUIET, timeout))
        publish = []  # sent, and the quiet second spent
    n = int(closed_b) if closed_b is not None else \
        _await_closed(store, me, timeout, say, quiet=0.0 if publish else _QUIET)
    if arrival > n:
        raise RendezvousClosed(f"refusing this {me.describe()}: the job closed with {n} nodes")
    keys = [_key(f"node/{k}") for k in range(1, n + 1)]
    infos = [NodeInfo.loads(raw if raw is not None else store.get(key))  # (not set yet)
             for key, raw in zip(keys, store.read_many(keys), strict=True)]
    ranks = assign_ranks(infos)
    by_rank = sorted(zip(ranks, infos, strict=True), key=lambda pair: pair[0])
    return Assignment(node_rank=ranks[arrival - 1], nnodes=n,
                      nodes=tuple(info for _, info in by_rank))


_QUIET = 1.0  #: a quiet first second: nodes started together meet within it


def _await_closed(store: Store, me: NodeInfo, timeout: float,
                  say: Callable[[str], None] | None, quiet: float = _QUIET) -> int:
    """Wait for the rendezvous to close and return its node count, saying so
    (``waiting_line``) when it takes more than ``quiet`` seconds (what is left of the
    first second); ``RendezvousError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + timeout))
    step = quiet
    while True:
        closed = store.wait_get(_key("closed"), max(min(step, deadline - time.monotonic()),
                                                    0.01))  # the wait and the read in one
        if closed is not None:
            return int(closed)
        if time.monotonic() >= deadline:
            got = store.add(_key("joined"), 0)
            raise RendezvousError(
                f"rendezvous timed out after {timeout:g}s: {got} of {me.min_nodes} nodes "
                f"joined. Start the other nodes' launchers with the same --rdzv-endpoint/"
                f"--master-addr/--master-port, or raise --rdzv-timeout.")
        if say is not None:
            waited = timeout - (deadline - time.monotonic())
            try:
                say(waiting_line(store, me, waited, until, timeout))
            except DistError:
                pass  # a line we could not make; the wait itself goes on, bounded
        step = PROGRESS_EVERY


def waiting_line(store: Store, me: NodeInfo, waited: float, until: str, timeout: float) -> str:
    """``rankwise run: waiting for 1 more node (...): here: h0; missing: node rank 1; ...``"""
    joined = int(store.add(_key("joined"), 0))
    here = [NodeInfo.loads(store.get(_key(f"node/{k}"))) for k in range(1, joined + 1)
            if store.check([_key(f"node/{k}")])]
    claimed = {info.node_rank for info in here if info.node_rank >= 0}
    missing = [r for r in range(me.min_nodes) if r not in claimed]
    need = max(me.min_nodes - joined, 0)
    names = ", ".join(f"{info.host} (launcher pid {info.pid}"
                      + (f", node rank {info.node_rank})" if info.node_rank >= 0 else ")")
                      for info in here)
    ranks = f"; missing: node rank{'s' if len(missing) > 1 else ''} " \
        f"{', '.join(map(str, missing))}" if claimed and missing else ""
    return (f"rankwise run: waiting for {need} more node{'s' if need != 1 else ''} "
            f"({joined} of {me.min_nodes} needed joined, waited {waited:.0f} s; here: {names}"
            f"{ranks}); giving up at {until} (--rdzv-timeout {timeout:g} s)")


class StorePeers:
    """Failure news between the nodes of a job, through the store (see module docstring).

    ``connect`` makes a fresh store client: the watcher thread needs its own connection
    because a client is not shared between threads.
    """

    def __init__(self, store: Store, connect: Callable[[], Store], node_rank: int) -> None:
        self._store = store
        self._connect = connect
        self._node = node_rank
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._attempt = 0

    def announce_failure(self, outcome: WorkerOutcome) -> None:
        a = self._attempt
        try:
            self._store.set(_key(f"r{a}/failure/{self._node}"), outcome.to_json())
            self._store.compare_set(_key(f"r{a}/failed"), "", str(self._node))
        except DistError:
            pass  # store gone (node 0 died): the other nodes' workers find out from the core

    def watch(self, restart_count: int, post: Callable[[str], None]) -> None:
        self._attempt = restart_count
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(restart_count, post),
                                        name="rankwise-peer-watch", daemon=True)
        self._thread.start()

    def _watch(self, attempt: int, post: Callable[[str], None]) -> None:
        try:
            store = self._connect()
        except DistError:
            return
        key = _key(f"r{attempt}/failed")
        try:
            while not self._stop.is_set():
                try:
                    store.wait([key], timeout=1.0)  # bounded, so stop_watching is noticed
                except DistTimeout:
                    continue
                node = int(store.get(key))
                if node != self._node:
                    outcome = self.remote_outcome(attempt, store)
                    post(cause_line(outcome) if outcome else f"a rank on node {node} failed")
                return
        except DistError:
            return  # the store went away: the core tells our workers about the lost peers
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()

    def remote_outcome(self, attempt: int, store: Store | None = None) -> WorkerOutcome | None:
        """The failed worker another node posted first in ``attempt``, if any."""
        store = store or self._store
        try:
            if not store.check([_key(f"r{attempt}/failed")]):
                return None
            node = int(store.get(_key(f"r{attempt}/failed")))
            if node == self._node:
                return None
            return WorkerOutcome.from_json(store.get(_key(f"r{attempt}/failure/{node}")).decode())
        except DistError:
            return None

    def stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3.0)
            self._thread = None

    def finish(self, nnodes: int, hosting: bool, timeout: float) -> None:
        """Say this node is done; the hosting node waits (bounded) for all before closing."""
        try:
            self._store.set(_key(f"end/{self._node}"), "1")
            if hosting:
                self._store.wait([_key(f"end/{n}") for n in range(nnodes)], timeout=timeout)
        except DistError:
            pass
