"""Heartbeats: a peer that goes silent becomes a ``PeerFailure``, with no socket closing.

Why: a network partition, a host that loses power or a frozen (SIGSTOPped) process closes
no connection, so nothing else ever fires and every rank would wait out the group timeout.
Each rank sends one small BEAT frame per ``interval`` to its ring successor and watches its
ring predecessor: O(1) traffic and threads per rank whatever the world size. A predecessor
silent past ``RANKWISE_HEARTBEAT_TIMEOUT`` seconds (default 15, see docs/heartbeats.md) fails
every wait here and is passed on to every peer this rank still reaches, which covers both
sides of a partition (each side has a rank whose predecessor is across the cut).

The beats come from background threads, so a rank busy in Python keeps beating (the
interpreter switches threads every 5 ms); only a C call that holds the GIL longer than the
timeout could be mistaken for a frozen process (docs/heartbeats.md). Sending and watching are
separate threads: a send blocked on a full socket must not stop this rank from watching.

Under ``rankwise run`` the launchers watch the nodes (``launch.beacon``, 3.5 s) and each
tells its own ranks of a lost node through a pipe (``LauncherNews``): that is how a lost
node reaches a rank within seconds. The ranks' own beats then default to
``LAUNCHED_HEARTBEAT_TIMEOUT`` (60 s): they only back up the launchers, and a rank that
holds the GIL for 20 s must not be reported as frozen.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
import weakref
from typing import TYPE_CHECKING, ClassVar

from .. import settings
from ..errors import DistError, PeerFailure
from ..transport.keepalive import (
    DEFAULT_TIMEOUT,
    LAUNCHED_HEARTBEAT_TIMEOUT,
    NEWS_ENV,
    heartbeat_timeout,
)
from ..wire.frames import Kind, encode_header

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["DEFAULT_TIMEOUT", "LAUNCHED_HEARTBEAT_TIMEOUT", "NEWS_ENV", "Heartbeat",
           "LauncherNews", "heartbeat_timeout"]



class Heartbeat:
    """Beats to this rank's ring successor; watches its ring predecessor."""

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self._comm = comm
        self.timeout = timeout
        #: one beat per second, more often only for short test timeouts (>= 4 per timeout)
        self.interval = min(1.0, timeout / 4)
        n = comm.world_size
        self.successor = (comm.rank + 1) % n
        self.predecessor = (comm.rank - 1) % n
        self.heard = time.monotonic()  #: when the predecessor's last beat arrived
        self.heard_wall = time.time()
        self.heard_any = False
        self.peer_host = ""  #: the predecessor's hostname, from its beats
        self._beat = socket.gethostname().encode()[:200]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=fn, name=f"rankwise-heartbeat-{what}",
                                          daemon=True)
                         for fn, what in ((self._send_loop, "send"), (self._watch_loop, "watch"))]

    @classmethod
    def create(cls, comm: Communicator) -> Heartbeat | None:
        """A heartbeat for ``comm`` (before its transport starts: the first beat from a
        peer may come at once), unless alone or turned off (timeout 0)."""
        timeout = heartbeat_timeout()
        if comm.world_size < 2:
            return None
        LauncherNews.listen(comm)
        return None if timeout == 0 else cls(comm, timeout)

    def start(self) -> None:
        """Start beating and watching (once the transport runs)."""
        self.heard = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def on_beat(self, src: int, payload: bytes) -> None:
        """A BEAT frame arrived (I/O thread): note when, and the sender's host."""
        if src == self.predecessor:
            self.heard = time.monotonic()
            self.heard_wall = time.time()
            if not self.heard_any:
                self.heard_any = True
                self.peer_host = payload.decode("utf-8", "replace")

    # --- threads --------------------------------------------------------------------------

    def _done(self) -> bool:
        return self._stop.is_set() or self._comm.closed

    def _send_loop(self) -> None:
        comm = self._comm
        header = encode_header(Kind.BEAT, payload_len=len(self._beat))
        while not self._done():  # the first beat at once: the watcher learns our host
            if comm.router.peer_gone(self.successor):
                return
            try:  # a long deadline: a send cut short mid-frame would corrupt the stream
                comm.transport.send(self.successor, header, self._beat,
                                    time.monotonic() + self.timeout)
            except DistError:
                return  # the connection is gone: the reader reports that peer
            except Exception:  # noqa: BLE001 - a closing transport; never kill the process
                return
            self._stop.wait(self.interval)

    def _watch_loop(self) -> None:
        tick = time.monotonic()
        while not self._stop.wait(self.interval) and not self._done():
            now = time.monotonic()
            if now - tick > self.interval + self.timeout / 2:
                # this process itself stood still (SIGSTOP, a debugger, a swapped-out
                # host): the beats that came meanwhile sit unread in the socket, so the
                # silence is ours. Start the predecessor's window afresh instead of
                # blaming it (a resumed rank blamed its live predecessor before)
                self.heard = now
            tick = now
            silent = now - self.heard
            if silent <= self.timeout:
                continue
            comm = self._comm
            pred = self.predecessor
            if comm.router.peer_gone(pred) or pred in comm.departures.bye \
                    or comm.router.failure is not None:
                return  # it left or failed some other way: that is already being reported
            self._report(silent)
            return

    def _report(self, silent: float) -> None:
        comm = self._comm
        pred = self.predecessor
        when = (time.strftime("%H:%M:%S", time.localtime(self.heard_wall))
                + f".{int(self.heard_wall % 1 * 1000):03d}")
        host = f" on host {self.peer_host}" if self.peer_host else ""
        heard = (f"last heard {silent:.1f} s ago at {when}" if self.heard_any
                 else f"never heard since rank {comm.rank} started watching {silent:.1f} s ago")
        exc = PeerFailure(
            f"rank {pred}{host} stopped answering: no heartbeat for more than "
            f"{self.timeout:g} s ({heard}; watched by rank {comm.rank}). Likely causes: "
            f"network partition, host down or frozen process (SIGSTOP, debugger). "
            f"RANKWISE_HEARTBEAT_TIMEOUT={self.timeout:g}",
            rank=pred, last_collective=comm.departures.last_from(pred),
        )
        comm.router.fail_all(exc)
        comm.broadcast_abort(comm.relay_of(exc), background=True)


class LauncherNews:
    """Reads this rank's news pipe from its launcher (``RANKWISE_NODE_NEWS``): each line is a
    lost node, raised at once as a ``PeerFailure`` in every wait of every communicator of
    this process that is still open, and passed on to the peers it still reaches (as a
    heartbeat's report). One reader thread per process, started with the first
    communicator; the pipe's end (EOF: the launcher is gone) stops it quietly."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _comms: ClassVar[weakref.WeakSet[Communicator]] = weakref.WeakSet()
    _started: ClassVar[bool] = False

    @classmethod
    def listen(cls, comm: Communicator) -> None:
        """Let ``comm`` hear the launcher's news (a no-op without a launcher's pipe)."""
        with cls._lock:
            cls._comms.add(comm)
            if cls._started:
                return
            fd = _news_fd(settings.text(NEWS_ENV) or "")
            if fd is None:
                return
            cls._started = True
        threading.Thread(target=cls._read, args=(fd,), name="rankwise-launcher-news",
                         daemon=True).start()

    @classmethod
    def _read(cls, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                try:
                    news = json.loads(line)
                    rank, message = int(news["rank"]), str(news["message"])
                except (ValueError, KeyError, TypeError):
                    continue
                with cls._lock:
                    comms = list(cls._comms)
                for comm in comms:
                    cls._raise(comm, rank, message, news)

    @staticmethod
    def _raise(comm: Communicator, rank: int, message: str, news: dict[str, object]) -> None:
        if comm.closed or comm.router.failure is not None or not 0 <= rank < comm.world_size:
            return
        exc = PeerFailure(
            f"{message} (found by the launcher of node {news.get('node')} on host "
            f"{news.get('host')}, which told rank {comm.rank})",
            rank=rank, last_collective=comm.departures.last_from(rank),
        )
        comm.router.fail_all(exc)
        comm.broadcast_abort(comm.relay_of(exc), background=True)


def _news_fd(spec: str) -> int | None:
    """The pipe's fd from ``<fd>:<inode>``, only if this process holds that very pipe."""
    fd_text, _, inode = spec.partition(":")
    try:
        fd, ino = int(fd_text), int(inode)
        st = os.fstat(fd)
    except (ValueError, OSError):
        return None
    if not stat.S_ISFIFO(st.st_mode) or st.st_ino != ino:
        return None
    os.set_inheritable(fd, False)  # a program it runs gets the variable, not the pipe
    return fd
