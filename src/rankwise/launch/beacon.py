"""Fast node liveness: the launchers beat each other directly over UDP, twice a second.

Why UDP and not the store: the store is one TCP connection to node 0, so a lost segment
holds every later beat behind its retransmission (on a 600 ms round trip link the
backoff is 1 s, then 2 s, then 4 s), and a node's beats cost a round trip each. A lost
datagram costs one beat and delays none: at 2 beats a second a 3.5 s timeout needs six
in a row lost, which a 1 %-loss link does about once in 10^12 beats.

Why the launcher's process: it never runs user code, so a rank that holds the GIL for
minutes cannot delay its node's beats. Each beat carries how long ago the sender last
heard the receiver, so a node whose beats no longer arrive on the other side (a one-way
partition) learns it from the other's beats, and both sides give a verdict.

Beats are authenticated (a truncated HMAC-SHA256 under a random per-round key of the
sender, published through the job's store, itself behind the job's token) and carry a
sequence number, so a stranger can neither fake a node's liveness nor, replaying or
forging a beat, make a node believe it is not heard. A node whose beats never arrived is
never judged here: the store's slower watch (``nodewatch``) still covers it, and the
launcher says once that beats do not get through (a firewall dropping UDP).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

from .. import settings

__all__ = ["DEFAULT_NODE_TIMEOUT", "Beacon", "node_timeout"]

#: seconds a node's beats may stop before it is lost (docs/heartbeats.md says why 3.5)
DEFAULT_NODE_TIMEOUT = 3.5
_ENV = "RANKWISE_NODE_TIMEOUT"
_HEAD = struct.Struct(">4sHQI")  # magic, sender node, sequence, ms since it heard us
_MAGIC = b"RWN1"
_MAC = 16
_NEVER = 0xFFFFFFFF


def node_timeout(heartbeats: float) -> float:
    """``RANKWISE_NODE_TIMEOUT`` in seconds (0: off). Unset, it is 3.5 s, or off when
    ``heartbeats`` (``RANKWISE_HEARTBEAT_TIMEOUT``) is 0; a bad value is refused."""
    return settings.number(_ENV, 0.0 if heartbeats == 0 else DEFAULT_NODE_TIMEOUT)


@dataclass
class _Peer:
    addr: tuple[str, int]
    key: bytes
    seq: int = -1  #: its last sequence number accepted
    heard: float = 0.0  #: when (monotonic) its last beat arrived; 0: never
    #: how long it had not heard us, as its last beat said (None: it never had)
    hears_us_age: float | None = None


class Beacon:
    """This node's UDP beats to every other node of a round, and what it hears of them."""

    def __init__(self, node: int, timeout: float, toward: str) -> None:
        """Bind on the address that routes to ``toward`` (the store's host)."""
        self.node = node
        self.timeout = timeout
        #: two beats a second; more often only for short test timeouts (>= 7 per timeout)
        self.interval = min(0.5, timeout / 7)
        family = socket.AF_INET6 if ":" in toward else socket.AF_INET
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.connect((toward, 9))  # no packet: it only picks the route's source
            local = probe.getsockname()[0]
        finally:
            probe.close()
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((local, 0))
        self._sock.settimeout(self.interval)
        self._key = secrets.token_bytes(16)
        self._peers: dict[int, _Peer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = 0
        self.started = time.monotonic()

    def record(self) -> str:
        """What the other nodes need to beat to us and to check our beats (for the store)."""
        host, port = self._sock.getsockname()[:2]
        return json.dumps({"host": host, "port": port, "key": self._key.hex()})

    def add_peer(self, node: int, record: bytes) -> None:
        """Another node's ``record``; beats to it start with the next round."""
        try:
            info = json.loads(record.decode())
            peer = _Peer((str(info["host"]), int(info["port"])), bytes.fromhex(info["key"]))
        except (ValueError, KeyError, TypeError):
            return  # not a record of ours: that node is never heard, the store watch judges
        with self._lock:
            self._peers.setdefault(node, peer)

    def known(self) -> set[int]:
        with self._lock:
            return set(self._peers)

    def start(self) -> None:
        for fn, what in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            threading.Thread(target=fn, name=f"rankwise-beacon-{what}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    # --- judging (the node watch's judge thread) ------------------------------------------

    def heard(self, node: int) -> float:
        """When ``node``'s last beat arrived (0: never, or not a peer)."""
        with self._lock:
            peer = self._peers.get(node)
            return peer.heard if peer is not None else 0.0

    def forgive(self, now: float) -> None:
        """This process itself stood still (SIGSTOP, a swapped-out host): the beats that
        came meanwhile are not read yet, so the silence is ours. Start every window afresh."""
        with self._lock:
            for peer in self._peers.values():
                if peer.heard:
                    peer.heard = now
                    peer.hears_us_age = None

    def verdict(self, node: int, now: float, limit: float) -> str:
        """Why ``node`` is lost ("" while it beats and hears us); never for a node never
        heard (the store's watch covers that one)."""
        with self._lock:
            peer = self._peers.get(node)
            if peer is None or not peer.heard:
                return ""
            silent, deaf = now - peer.heard, peer.hears_us_age
        if silent > limit:
            return (f"stopped answering {silent:.1f} s ago: its launcher's beats stopped "
                    f"arriving (network partition, host down or its launcher was killed; "
                    f"RANKWISE_NODE_TIMEOUT={self.timeout:g})")
        if deaf is not None and deaf > limit:
            return (f"stopped answering: its launcher's beats still arrive but say it has "
                    f"not heard this node for {deaf:.1f} s (a one-way network partition; "
                    f"RANKWISE_NODE_TIMEOUT={self.timeout:g})")
        return ""

    # --- threads ----------------------------------------------------------------------------

    def _mac(self, key: bytes, head: bytes) -> bytes:
        return hmac.new(key, head, hashlib.sha256).digest()[:_MAC]

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat(time.monotonic())
            except Exception:  # noqa: BLE001, S110 - a dead beat thread reads as a lost node
                pass
            self._stop.wait(self.interval)
        self._sock.close()

    def beat(self, now: float) -> None:
        """One beat to every peer, each saying how long ago (``now``) we last heard it."""
        with self._lock:
            peers = [(p.addr, p.heard) for p in self._peers.values()]
        self._seq += 1
        for addr, heard in peers:
            # clamped: the receive thread may note a beat after ``now`` was read
            age = _NEVER if not heard else min(max(int((now - heard) * 1000), 0), _NEVER - 1)
            head = _HEAD.pack(_MAGIC, self.node, self._seq, age)
            try:
                self._sock.sendto(head + self._mac(self._key, head), addr)
            except OSError:
                pass  # unreachable now: the silence is what the other side judges

    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(256)
            except OSError:  # the timeout (a look at _stop), or the socket closed
                continue
            if len(data) != _HEAD.size + _MAC:
                continue
            head, mac = data[:_HEAD.size], data[_HEAD.size:]
            magic, node, seq, age = _HEAD.unpack(head)
            with self._lock:
                peer = self._peers.get(node)
                if magic != _MAGIC or peer is None or seq <= peer.seq \
                        or not hmac.compare_digest(mac, self._mac(peer.key, head)):
                    continue  # not a beat, a stranger's, a replay or out of order
                peer.seq = seq
                peer.heard = time.monotonic()
                peer.hears_us_age = None if age == _NEVER else age / 1000
