"""Simulated hosts for tests: network namespaces joined by a bridge, each with its own hostname.

Why this shape: a partition must be *silent* (no RST, no ICMP, the local link stays up), as
when a switch port dies between two machines. Each host namespace ``<prefix>-h<i>`` has an
``eth0`` (10.213.0.<i+1>/24) whose veth peer is a port of ``br0`` in a third namespace
``<prefix>-br``; :meth:`SimHosts.cut` detaches that port from the bridge, so frames leave
``eth0`` and vanish, and :meth:`SimHosts.heal` attaches it again. Nothing is reachable from
the root namespace and no address outside 10.213.0.0/24 is ever used (netem and iptables are
not assumed: this machine's kernel has neither).

Each host also has its own temp folder (``TMPDIR``), as a machine has its own ``/tmp``: a
test that kills a whole host (its launcher's watchdog included) leaves that host's scratch
files in that folder only, and :meth:`SimHosts.close` removes it.

Everything is torn down by :meth:`SimHosts.close` (processes inside the namespaces first),
and namespaces that a dead test process left behind are removed by :func:`remove_stale`
(their names carry the creating pid).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PREFIX = "net-"
SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    name = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"`ip netns add` refused: {made.stderr.strip()}"
        probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "true"],
                               check=False, capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            return f"`unshare --uts` refused: {probe.stderr.strip()}"
        return ""
    finally:
        _ip("netns", "del", name, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (all were started by us)."""
    for _ in range(20):
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        if not out:
            return
        for pid in out:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)


def remove_stale() -> list[str]:
    """Delete ``net-<pid>-*`` namespaces (and their hosts' temp folders) whose creating
    process is gone; return the namespaces' names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):  # the hosts' temp folders (``SimHosts.tmpdirs``)
        owner = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if "-tmp-" in name and owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return removed


class SimHosts:
    """``n`` simulated hosts on one bridge; use as a context manager."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(n)]
        self.hostnames = [f"h{i}" for i in range(n)]
        self._procs: list[subprocess.Popen[Any]] = []
        self._closers: list[Callable[[], None]] = []
        self.tmpdirs = [tempfile.mkdtemp(prefix=f"{ns}-tmp-") for ns in self.hosts]
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            _ip("-n", self.bridge_ns, "link", "add", f"p{i}", "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``i`` under its own hostname ``h<i>``."""
        return ["ip", "netns", "exec", self.hosts[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[i],
                "env", f"TMPDIR={self.tmpdirs[i]}", *argv]

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.command(i, argv), start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(i, argv), check=False, capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, i: int) -> list[int]:
        """Processes running inside host ``i`` now."""
        return [int(p) for p in _ip("netns", "pids", self.hosts[i], check=False).stdout.split()]

    def cut(self, i: int) -> None:
        """Silently cut host ``i`` off: its bridge port leaves the bridge, its own link stays up."""
        _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "nomaster")

    def heal(self, i: int) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0")

    def cut_one_way(self, src: int, dst: int) -> None:
        """Silently drop what host ``src`` sends to host ``dst``; the other way still works.
        How, with neither netfilter nor tc filters: ``src`` gets a permanent neighbour
        entry for ``dst``'s address with a MAC nobody has, so its frames are flooded by
        the bridge and dropped by every host (not addressed to it)."""
        _ip("-n", self.hosts[src], "neigh", "replace", self.addr(dst), "lladdr",
            "02:00:5e:00:53:ff", "nud", "permanent", "dev", "eth0")

    def power_off(self, i: int) -> None:
        """Host ``i`` loses power: its link goes first (nothing it sends on the way down,
        no FIN, no RST, arrives), then every process inside it is SIGKILLed."""
        self.cut(i)
        _kill_inside(self.hosts[i])

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` first in :meth:`close` (a helper's own teardown: ``_netns_netem``)."""
        self._closers.append(fn)

    def close(self) -> None:
        for fn in self._closers:
            fn()
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in [*self.hosts, self.bridge_ns]:
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        for proc in self._procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        for tmp in self.tmpdirs:
            shutil.rmtree(tmp, ignore_errors=True)

    def __enter__(self) -> SimHosts:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def two_hosts() -> Iterator[SimHosts]:
    """Two fresh simulated hosts (stale ones of dead test processes removed first), closed
    after the test: the body of the ``hosts`` fixture of every namespace test module."""
    remove_stale()
    sim = SimHosts(2)
    try:
        yield sim
    finally:
        sim.close()
