"""A healthy fake machine for the doctor's checks, and fakes of its probes; each test
changes one thing and expects the one finding that names it."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from typing import Any

from rankwise.doctor import Cpus, GpuProbes, Inputs, NetProbes, PortState, ShmSpace

GiB = 1 << 30


class FakeNet(NetProbes):
    """Name resolution from a table; bind errors and port answers as given."""

    def __init__(self, hosts: Mapping[str, Any] | None = None,
                 bind: Mapping[int, int] | None = None,
                 answers: Mapping[int, PortState] | None = None,
                 local: tuple[str, ...] = ("127.0.0.1", "10.0.0.5")) -> None:
        super().__init__()
        self.hosts = {"node0": ["10.0.0.5"], "localhost": ["127.0.0.1"],
                      "127.0.0.1": ["127.0.0.1"], "10.0.0.5": ["10.0.0.5"],
                      "10.0.0.9": ["10.0.0.9"], **(hosts or {})}
        self.bind = dict(bind or {})
        self.answers = dict(answers or {})
        self.local = local
        self.probed: list[tuple[str, int]] = []

    def resolve(self, host: str) -> list[str]:
        value = self.hosts.get(host)
        if value is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if isinstance(value, BaseException):
            raise value
        return list(value)

    def bind_error(self, ip: str, port: int) -> OSError | None:
        code = self.bind.get(port)
        return None if code is None else OSError(code, os.strerror(code))

    def is_local(self, ip: str) -> bool:
        return ip in self.local

    def probe(self, ip: str, port: int) -> tuple[PortState, str]:
        self.probed.append((ip, port))
        return self.answers.get(port, PortState.REFUSED), "fake"


class FakeGpus(GpuProbes):
    def __init__(self, count: int | None = None, physical: int | None = None,
                 torch: str | None = "2.13.0") -> None:
        super().__init__(import_torch=False)
        self.count, self.physical, self.torch = count, physical, torch

    def torch_version(self) -> str | None:
        return self.torch

    def device_count(self) -> int | None:
        return self.count

    def physical_count(self) -> int | None:
        return self.physical


def healthy(**changes: Any) -> Inputs:
    """A machine with nothing wrong: 16 CPUs, 8 GiB /dev/shm, 65536 open files, eth0."""
    base: dict[str, Any] = {
        "env": {}, "hostname": "node0", "interfaces": ["lo", "eth0"],
        "shm": ShmSpace(8 * GiB, 8 * GiB), "nofile": (65536, 65536),
        "cpus": Cpus(16.0, "16 CPUs (fake)"), "net": FakeNet(), "gpus": FakeGpus()}
    base.update(changes)
    return Inputs(**base)


def in_use() -> dict[int, int]:
    return {29500: errno.EADDRINUSE}
