"""Launchers of a multi-node job watch each other through the store.

Why: a node that is cut off or loses power closes no connection, so the launcher of the
other side learned of it only from its own ranks (if at all) and then waited for the lost
node's "finished" record until the rendezvous timeout. Here each launcher bumps its counter
``rankwise/nodebeat/<node>`` once per second and reads the others'; a counter that stops
moving for ``RANKWISE_HEARTBEAT_TIMEOUT`` seconds (the ranks' heartbeat timeout, default 15)
names that node, its host and its ranks. A launcher that cannot reach the store (hosted by
node 0) for as long reports node 0 the same way. The store I/O runs in one thread and the
judging in another, so a store call blocked on a silent network never delays the verdict.

That watch is the backstop. The fast one is the launchers' UDP beats (``launch.beacon``,
``RANKWISE_NODE_TIMEOUT``, 3.5 s): their addresses and keys travel in the same store
beats, and a node they find lost is judged like one the store found lost. A verdict
(``NodeVerdict``) carries the first rank of the lost node, so the agent can hand it to its
own ranks at once (``LocalAgent.abort``) rather than let them wait for their own, slower
heartbeats.

``Detached`` runs the launcher's best-effort store writes (failure and exit notices) in
order on a thread of their own, so a silent store never stalls the teardown of the ranks.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DistError
from ..store.base import Store
from ..transport.keepalive import heartbeat_timeout
from .beacon import Beacon, node_timeout
from .rendezvous import PREFIX
from .summary import WorkerOutcome

__all__ = ["Detached", "DetachedPeers", "NodeVerdict", "NodeWatch", "as_death",
           "describe_node"]

_KEY = "rankwise/nodebeat/"
_UDP = "rankwise/nodebeat/udp/"  #: a node's beacon address and key (``Beacon.record``)


class NodeVerdict(str):
    """A lost node's description, carrying the first of its ranks (``rank``): what a rank
    here raises is a ``PeerFailure`` that blames that rank, not itself."""

    rank: int | None = None

    @classmethod
    def of(cls, text: str, rank: int) -> NodeVerdict:
        verdict = cls(text)
        verdict.rank = rank
        return verdict


def _say(text: str) -> None:
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def describe_node(node: int, host: str, nproc: int) -> str:
    """``node 1 (h1, ranks 2-3)``."""
    first, last = node * nproc, node * nproc + nproc - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"node {node} ({host}, {ranks})"


class NodeWatch:
    """Beats for this node through the store and judges the other nodes' beats."""

    def __init__(self, connect: Callable[[], Store], node: int, hosts: Sequence[str],
                 nproc: int, timeout: float | None = None,
                 fast_timeout: float | None = None) -> None:
        self._connect = connect
        self.node = node
        self.hosts = list(hosts)
        self.nproc = nproc
        self.timeout = heartbeat_timeout() if timeout is None else timeout
        self.interval = min(1.0, max(self.timeout, 0.1) / 4)
        #: the UDP beats' timeout (``launch.beacon``; 0: none)
        self.fast_timeout = node_timeout(self.timeout) if fast_timeout is None else fast_timeout
        self.beacon: Beacon | None = None
        self._unpublished = ""  #: the beacon's record, until a store beat carried it
        self._warned: set[int] = set()  #: nodes said to send no UDP beats
        now = time.monotonic()
        self.store_ok_at = now  #: last time a store call of ours came back
        self._heard = {n: now for n in range(len(hosts)) if n != node}
        self._counts: dict[int, int] = {}
        self._ended: set[int] = set()
        self._stop = threading.Event()
        self._post: Callable[[str], None] = lambda text: None
        #: why a node counts as lost ("" while none is): the launcher's root cause
        self.lost = ""
        self.lost_node: int | None = None  #: the node the last verdict named
        self.store_lost = False  #: this node cannot reach the store
        #: the beat and judge threads run: one node, or a timeout of 0, judges nobody, and
        #: then no silence may be read as a lost node or a lost store
        self.watching = False

    def start(self, post: Callable[[str], None]) -> None:
        """Start watching (a no-op for one node or a timeout of 0); ``post`` gets the verdict."""
        if len(self.hosts) < 2 or self.timeout == 0:
            return
        self.watching = True
        self._post = post
        for fn, what in ((self._beat_loop, "beat"), (self._judge_loop, "judge")):
            threading.Thread(target=fn, name=f"rankwise-node-{what}", daemon=True).start()

    def store_answers(self) -> bool:
        """Did the store answer lately (within three beats)? When not, the launcher skips
        what it would still ask the store at the end: it would only wait on a cut link.
        True when not watching: nothing was measured, so nothing says the store is gone."""
        if not self.watching:
            return True
        return not self.store_lost and time.monotonic() - self.store_ok_at < 3 * self.interval + 0.5

    def stop(self) -> None:
        self._stop.set()
        if self.beacon is not None:
            self.beacon.stop()

    # --- threads ----------------------------------------------------------------------------

    def _beat_loop(self) -> None:
        store: Store | None = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                self._store_beat(store)
                self.store_ok_at = time.monotonic()
            except DistError:
                _close(store)
                store = None
            self._stop.wait(self.interval)
        if store is not None:
            try:
                store.set(f"{_KEY}{self.node}/end", "1")
            except DistError:
                pass
            _close(store)

    def _store_beat(self, store: Store) -> None:
        """One round trip: our beat, the others' counters and ends, beacon records."""
        publish = self._start_beacon(store) or self._unpublished
        others = sorted(self._heard)
        open_ = [n for n in others if n not in self._ended]
        missing = [] if self.beacon is None else \
            [n for n in others if n not in self.beacon.known()]
        ops: list[tuple[Any, ...]] = [("set", f"{_UDP}{self.node}", publish)] if publish else []
        ops += [("add", f"{_KEY}{self.node}", 1)]
        ops += [("add", f"{_KEY}{n}", 0) for n in others]
        ops += [("read", key) for n in open_ for key in (f"{_KEY}{n}/end", f"{PREFIX}end/{n}")]
        ops += [("read", f"{_UDP}{n}") for n in missing]
        got = iter(store.batch(ops)[1 if publish else 0:])
        self._unpublished = ""  # out: the others can beat to us
        next(got)
        for n in others:
            count = next(got)
            if count != self._counts.get(n):
                self._counts[n] = count
                self._heard[n] = time.monotonic()
        for n in open_:
            beats_end, finished = next(got), next(got)  # both read: the order is positional
            if beats_end is not None or finished is not None:
                self._ended.add(n)
        for n in missing:
            record = next(got)
            if record is not None and self.beacon is not None:
                self.beacon.add_peer(n, record)

    def _start_beacon(self, store: Store) -> str:
        """The UDP beats, once the store's host is known; their record, to publish ("" when
        published already, or when there are none)."""
        if self.beacon is not None or self.fast_timeout == 0:
            return ""
        host = getattr(store, "host", None) or \
            getattr(getattr(store, "underlying_store", None), "host", None)
        if not isinstance(host, str):
            self.fast_timeout = 0.0  # an in-process store: nothing to route beats by
            return ""
        try:
            self.beacon = Beacon(self.node, self.fast_timeout, host)
        except OSError:
            self.fast_timeout = 0.0
            return ""
        self.beacon.start()
        self._unpublished = self.beacon.record()  # until a store beat carried it
        return self._unpublished

    def _judge_loop(self) -> None:
        step = self.interval if not self.fast_timeout else \
            min(self.interval, self.fast_timeout / 14)
        tick = time.monotonic()
        while not self._stop.wait(step):
            now = time.monotonic()
            beacon = self.beacon
            if beacon is not None and now - tick > beacon.interval + beacon.timeout / 2:
                beacon.forgive(now)  # we stood still, not the others
            tick = now
            self._warn_unheard(now)
            verdict = self.verdict(now)
            if verdict:
                self.lost = verdict
                self._post(verdict)
                return

    def _warn_unheard(self, now: float) -> None:
        """Say once per node that its UDP beats never came (its store beats did): a lost
        node is then found by the store's watch only, in RANKWISE_HEARTBEAT_TIMEOUT."""
        beacon = self.beacon
        if beacon is None or now - beacon.started < 4 * beacon.timeout:
            return
        for n in sorted(beacon.known() - self._warned):
            if not beacon.heard(n) and now - self._heard.get(n, now) < self.interval * 3:
                self._warned.add(n)
                _say(f"rankwise run: warning: no UDP beats from "
                     f"{describe_node(n, self.hosts[n], self.nproc)} (a firewall?); a lost "
                     f"node is found in {self.timeout:g} s (RANKWISE_HEARTBEAT_TIMEOUT) "
                     f"instead of {beacon.timeout:g} s")

    def suspect(self) -> str:
        """After the job failed: a node silent for three beats already, though not yet for
        the timeout, named the same way -- the likely root cause the summary leads with."""
        if not self.watching:
            return ""
        return self.verdict(time.monotonic(), 3 * self.interval + 0.5)

    def await_suspect(self) -> str:
        """:meth:`suspect`, waiting for it up to four beats (and not at all when this
        node does not watch: one node, or a timeout of 0). Four, not three: the beat
        thread notes a node's last beat up to one beat after it was made, so a node that
        vanished just now may have been heard less than a beat ago."""
        if not self.watching:
            return ""
        deadline = time.monotonic() + 4 * self.interval + 1.0
        while not (found := self.suspect()) and time.monotonic() < deadline:
            time.sleep(0.1)  # bounded polling of the beat thread's records
        return found

    def verdict(self, now: float, limit: float | None = None) -> str:
        """The lost node's description (a ``NodeVerdict``), or "" while every node answers."""
        fast = self.fast_timeout if limit is None else min(limit, self.fast_timeout)
        limit = self.timeout if limit is None else limit
        silent = now - self.store_ok_at
        if self.node != 0 and silent > limit and 0 not in self._ended:
            self.store_lost = limit == self.timeout
            self.lost_node = 0
            return NodeVerdict.of(
                f"{describe_node(0, self.hosts[0], self.nproc)} stopped answering "
                f"{silent:.1f} s ago: this node cannot reach the job's store there "
                "(network partition, host down or its launcher was killed)", 0)
        beacon = self.beacon
        for n, heard in sorted(self._heard.items()):
            if n in self._ended:
                continue
            why = "" if beacon is None or not fast else beacon.verdict(n, now, fast)
            if not why and now - heard > limit:
                why = (f"stopped answering {now - heard:.1f} s ago: its launcher no longer "
                       "reaches the store (network partition, host down or its launcher "
                       "was killed)")
            if why:
                self.lost_node = n
                return NodeVerdict.of(f"{describe_node(n, self.hosts[n], self.nproc)} {why}",
                                      n * self.nproc)
        return ""


def as_death(watch: NodeWatch, verdict: str, outcomes: Sequence[WorkerOutcome]) -> str:
    """``verdict`` said as "node N ... died" when this node's ranks all lost their
    connections to that node's ranks (closed, not silent: its processes were killed or its
    host went down, not a partition), else ``verdict`` as it is."""
    n = watch.lost_node
    blamed = [o for o in outcomes if o.blames is not None and o.error is not None]
    if not verdict or n is None or not blamed:
        return verdict
    ranks = range(n * watch.nproc, (n + 1) * watch.nproc)
    if any(o.blames not in ranks or "died:" not in str(o.error and o.error.get("message"))
           for o in blamed):
        return verdict
    return (f"{describe_node(n, watch.hosts[n], watch.nproc)} died: its ranks' connections "
            "closed without a goodbye and its launcher stopped beating (its processes were "
            "killed, or its host went down)")


def _close(store: Store | None) -> None:
    """Close a store client, ignoring errors (it may be cut off)."""
    close = getattr(store, "close", None)
    if callable(close):
        try:
            close()
        except (DistError, OSError):
            pass


class Detached:
    """Runs best-effort calls in order on one daemon thread (started on first use)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while (fn := self._queue.get()) is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001, S110 - best effort: the store may be gone
                pass

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the calls submitted so far."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(done.set)
        done.wait(timeout)


class DetachedPeers:
    """A ``RoundPeers`` whose failure announcement never blocks the agent's monitor."""

    def __init__(self, peers: Any, runner: Detached) -> None:
        self._peers = peers
        self._runner = runner

    def announce_failure(self, outcome: WorkerOutcome) -> None:
        self._runner.submit(lambda: self._peers.announce_failure(outcome))

    def watch(self, restart_count: int, post: Callable[[str], None]) -> None:
        self._peers.watch(restart_count, post)

    def stop_watching(self) -> None:
        self._peers.stop_watching()
