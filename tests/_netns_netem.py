"""A lossy, slow link for a simulated host, in user space: what ``tc netem`` would do.

Why: this machine's kernel has no netem qdisc (nor netfilter), and the no-false-report
promise is about a link like ``netem delay 300ms 100ms loss 1%``. :func:`make_lossy`
replaces host ``i``'s veth by two TAP devices, one a port of the bridge and one the host's
``eth0`` (same address), and a thread of the test process moves every frame between them
after a delay drawn uniformly from ``delay +- jitter`` (netem's default, which reorders
frames too), dropping each with probability ``loss``, in each direction. ARP goes
through it as well, so every packet the host sends or receives pays.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import random
import secrets
import select
import struct
import threading
import time

from _netns import SimHosts, _ip

__all__ = ["LossyLink", "make_lossy", "unavailable"]

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def unavailable() -> str:
    """Why no lossy link can be made here ("" when it can)."""
    return "" if os.path.exists("/dev/net/tun") else "no /dev/net/tun (TAP devices)"


def _tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class LossyLink:
    """The forwarding thread between a host's two TAP ends; ``close`` removes both."""

    def __init__(self, fds: tuple[int, int], delay: float, jitter: float, loss: float,
                 seed: int) -> None:
        self._fds = fds
        self._delay, self._jitter, self._loss = delay, jitter, loss
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self.frames = [0, 0]  #: frames seen each way (host -> bridge, bridge -> host)
        self.dropped = [0, 0]
        self._thread = threading.Thread(target=self._run, name="netem", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due: list[tuple[float, int, int, bytes]] = []  # (when, order, out fd, frame)
        order = itertools.count()
        host, bridge = self._fds
        while not self._stop.is_set():
            wait = 0.05 if not due else max(0.0, min(0.05, due[0][0] - time.monotonic()))
            ready, _, _ = select.select([host, bridge], [], [], wait)
            for fd in ready:
                way = 0 if fd == host else 1
                while True:
                    try:
                        frame = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    self.frames[way] += 1
                    if self._rng.random() < self._loss:
                        self.dropped[way] += 1
                        continue
                    when = time.monotonic() + self._rng.uniform(self._delay - self._jitter,
                                                                self._delay + self._jitter)
                    heapq.heappush(due, (when, next(order), bridge if way == 0 else host,
                                         frame))
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, _, out, frame = heapq.heappop(due)
                try:
                    os.write(out, frame)
                except OSError:
                    pass  # a full queue drops, as a real link would

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for fd in self._fds:
            os.close(fd)  # non-persistent TAP devices go with their fd


def make_lossy(hosts: SimHosts, i: int, delay: float = 0.3, jitter: float = 0.1,
               loss: float = 0.01) -> LossyLink:
    """Put host ``i`` behind a ``delay +- jitter``, ``loss`` link (each way)."""
    tag = secrets.token_hex(3)
    names = (f"rwh{tag}", f"rwb{tag}")  # made in this namespace, then moved
    fds = (_tap(names[0]), _tap(names[1]))
    ns = hosts.hosts[i]
    _ip("-n", ns, "link", "del", "eth0")  # the veth pair goes, its bridge port too
    _ip("link", "set", names[1], "netns", hosts.bridge_ns)
    _ip("-n", hosts.bridge_ns, "link", "set", names[1], "master", "br0", "up")
    _ip("link", "set", names[0], "netns", ns)
    _ip("-n", ns, "link", "set", names[0], "name", "eth0")
    _ip("-n", ns, "addr", "add", f"{hosts.addr(i)}/24", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    link = LossyLink(fds, delay, jitter, loss, seed=i)
    hosts.on_close(link.close)
    return link
