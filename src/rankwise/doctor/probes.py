"""The doctor's contact with the real machine, each piece bounded in time.

Checks never touch sockets, files or torch themselves: they ask a :class:`NetProbes` or
:class:`GpuProbes` (tests pass fakes). Everything here is bounded: name resolution runs
in a daemon thread that is abandoned after its timeout (``getaddrinfo`` cannot be
interrupted), sockets carry timeouts, and torch is imported only when asked for.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TypeVar

from ..errors import AuthError, DistError
from ..wire.auth import NotRankwiseEndpoint, client_handshake, resolve_token

__all__ = ["GpuProbes", "NetProbes", "PortState", "bounded"]

T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()``, or ``TimeoutError`` after ``timeout`` seconds (the call is left running
    in a daemon thread: a stuck DNS server or driver must not stop the doctor)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"rankwise-doctor:{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g}s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class PortState(Enum):
    """What answers on a TCP port."""

    RANKWISE_STORE = "a rankwise store that accepts this environment's token"
    TOKEN_DIFFERS = "a rankwise store that refuses this environment's token"
    OTHER_PROGRAM = "a program that is not a rankwise store"
    REFUSED = "nothing (connection refused)"
    NO_ANSWER = "no answer (packets dropped: firewall, or an unroutable address)"
    UNREACHABLE = "an error: the address is unreachable from here"


class NetProbes:
    """Name resolution and port probes against the real network."""

    def __init__(self, resolve_timeout: float = 2.0, connect_timeout: float = 1.0,
                 token: bytes | None = None, token_from_env: bool = True) -> None:
        """``token``: what the probe proves to a store; with ``token_from_env`` (and no
        ``token``) the environment's, as a rank started here would use."""
        self.resolve_timeout = resolve_timeout
        self.connect_timeout = connect_timeout
        self.token = token
        self.token_from_env = token_from_env and token is None
        self._resolved: dict[str, list[str] | OSError | TimeoutError] = {}

    def resolve(self, host: str) -> list[str]:
        """IPv4/IPv6 addresses of ``host``; ``OSError``/``TimeoutError`` when it fails.
        Answers (failures too) are kept: several checks ask for MASTER_ADDR, and a
        resolver that hangs must cost its timeout once, not once per check."""
        if host not in self._resolved:
            try:
                infos = bounded(lambda: socket.getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                self.resolve_timeout, f"resolving {host!r}")
                self._resolved[host] = list(dict.fromkeys(str(info[4][0]) for info in infos))
            except (OSError, TimeoutError) as exc:
                self._resolved[host] = exc
        answer = self._resolved[host]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def bind_error(self, ip: str, port: int) -> OSError | None:
        """Why the store could not listen on ``ip:port`` (``None``: it could)."""
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does
            sock.bind((ip, port))
            sock.listen(1)
            return None
        except OSError as exc:
            return exc
        finally:
            sock.close()

    def is_local(self, ip: str) -> bool:
        """Whether ``ip`` is an address of this machine (a store could listen on it)."""
        err = self.bind_error(ip, 0)
        return err is None or err.errno != errno.EADDRNOTAVAIL

    def probe(self, ip: str, port: int) -> tuple[PortState, str]:
        """Who answers on ``ip:port``, with a detail for the evidence. A rankwise store is
        recognised by its handshake, made with this environment's token (a token that
        differs is counted by that store as a failed check, which is what it is)."""
        token = self.token
        if self.token_from_env:
            try:
                token = resolve_token(None)
            except AuthError:
                token = None
        try:
            sock = socket.create_connection((ip, port), timeout=self.connect_timeout)
        except ConnectionRefusedError as exc:
            return PortState.REFUSED, str(exc)
        except TimeoutError as exc:
            return PortState.NO_ANSWER, f"no reply within {self.connect_timeout:g}s ({exc})"
        except OSError as exc:
            return PortState.UNREACHABLE, str(exc)
        try:
            sock.settimeout(self.connect_timeout)
            client_handshake(sock, token, "store", f"{ip}:{port}")
            return PortState.RANKWISE_STORE, "it completed rankwise's store handshake"
        except NotRankwiseEndpoint as exc:
            return PortState.OTHER_PROGRAM, str(exc)
        except AuthError as exc:
            return PortState.TOKEN_DIFFERS, str(exc)
        except DistError as exc:  # silent or hung up: not a rankwise store
            return PortState.OTHER_PROGRAM, f"it did not answer rankwise's handshake ({exc})"
        finally:
            sock.close()


class GpuProbes:
    """What CUDA offers, through torch (imported only if ``import_torch`` or already
    imported) and the NVIDIA driver's ``/proc`` listing (no CUDA initialisation)."""

    def __init__(self, import_torch: bool = True, timeout: float = 30.0,
                 proc_gpus: str = "/proc/driver/nvidia/gpus") -> None:
        self.import_torch = import_torch
        self.timeout = timeout
        self.proc_gpus = proc_gpus

    def device_count(self) -> int | None:
        """``torch.cuda.device_count()``; ``None`` when torch or its CUDA build is absent."""
        import sys

        if "torch" not in sys.modules and not self.import_torch:
            return None

        def count() -> int | None:
            try:
                import torch
            except ImportError:
                return None
            if getattr(torch.version, "cuda", None) is None:
                return None
            return int(torch.cuda.device_count())

        # a hung or broken driver raises (TimeoutError, RuntimeError): the check runner
        # turns that into a finding with the error as evidence, not "no GPU"
        return bounded(count, self.timeout, "torch.cuda.device_count()")

    def torch_version(self) -> str | None:
        """The installed torch's version, read from its package metadata (torch is not
        imported for it); ``None`` when torch is not installed."""
        import sys
        from importlib import metadata

        loaded = sys.modules.get("torch")
        if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
            return str(loaded.__version__)
        try:
            return metadata.version("torch")
        except metadata.PackageNotFoundError:
            return None

    def physical_count(self) -> int | None:
        """GPUs the NVIDIA driver knows, regardless of CUDA_VISIBLE_DEVICES (``None``:
        no NVIDIA driver here)."""
        path = Path(self.proc_gpus)
        try:
            return sum(1 for _ in path.iterdir())
        except OSError:
            return None


def read_text(path: str) -> str | None:
    """A small system file's text, ``None`` if unreadable (absent cgroup files etc.)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(4096)
    except OSError:
        return None


def usable_cpus_from_affinity() -> int:
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else (os.cpu_count() or 1)
