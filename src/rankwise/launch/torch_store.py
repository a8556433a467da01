"""torch's own ``TCPStore``, hosted by node 0's launcher for scripts that use only torch.

Why: a script that never imports rankwise calls ``init_process_group("gloo")`` with
``env://``, and torch's client speaks only torch's store protocol. So ``MASTER_PORT`` is a
port served by torch's own ``TCPStore`` server (as under torchrun, which hosts it in its
agent), and rankwise's token-protected store stays on ``--master-port``, found by rankwise
ranks through ``RANKWISE_STORE_ADDR``/``RANKWISE_STORE_PORT`` (``launch.env``). The two
stores are separate servers on separate ports: a connection to torch's cannot reach a key
of rankwise's (docs/design.md, "Plain torch scripts under rankwise run").

How, cheaply: the launcher binds the listening socket itself (no torch import) and hands
it to torch only when a first client knocks (``TCPStore(master_listen_fd=...)``); a job of
rankwise ranks never imports torch in the launcher. A knock is also how the launcher
learns that plain torch ranks run: it says once what they do not get. Each attempt gets a
fresh store on a fresh port (torch's keys of a failed attempt must not meet the next one's
ranks); node 0 publishes its port under ``rankwise/torch-store/<attempt>`` in rankwise's
store, where the other nodes' launchers read it.
"""

from __future__ import annotations

import importlib.util
import os
import select
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import DistError, DistTimeout
from ..store.base import Store
from ..store.tcp_server import resolve_bind_address

__all__ = ["PLAIN_TORCH_LINE", "TorchStoreHost", "TorchStorePort", "torch_installed",
           "torch_store_for"]

#: what the launcher says once when plain torch ranks reach torch's store
PLAIN_TORCH_LINE = (
    "rankwise run: ranks use torch.distributed without rankwise (torch's store at "
    "MASTER_PORT): they get this launcher's failure summary, watchdog, restarts and node "
    "heartbeats, not rankwise's per-call checks. To add those, change one line: `import "
    "rankwise.torch` and backend \"rankwise\", or `import rankwise as dist`."
)

_KEY = "rankwise/torch-store/"


def torch_installed() -> bool:
    """Whether this interpreter could host torch's store (found, not imported)."""
    return importlib.util.find_spec("torch") is not None


class _OneStore:
    """One attempt's torch store: a listening socket, handed to torch at the first knock."""

    def __init__(self, host: str, on_first: Callable[[], None],
                 say: Callable[[str], None]) -> None:
        family, addr = resolve_bind_address(host, 0)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(addr)
        self._sock.listen(1024)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._on_first = on_first
        self._say = say
        self._wake_r, self._wake_w = os.pipe()
        self._server: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve_on_knock, daemon=True,
                                        name=f"rankwise-torch-store-{self.port}")
        self._thread.start()

    def _serve_on_knock(self) -> None:
        ready, _, _ = select.select([self._sock.fileno(), self._wake_r], [], [])
        if self._sock.fileno() not in ready:
            return
        self._on_first()
        try:
            import torch.distributed as tdist  # the import costs seconds: only when used

            server = tdist.TCPStore(  # type: ignore[attr-defined]
                self.host, self.port, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=60), master_listen_fd=os.dup(self._sock.fileno()))
        except (ImportError, RuntimeError, OSError) as exc:
            self._say(f"rankwise run: warning: could not start torch's store on port "
                      f"{self.port} ({exc}); plain torch ranks cannot rendezvous")
            return
        with self._lock:
            if self._closed:
                del server
                return
            self._server = server

    def close(self) -> None:
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=30.0)
        del server  # torch's server stops (and closes its copy of the socket) when freed
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class TorchStoreHost:
    """Node 0's torch stores, one per attempt (``port_for`` opens the attempt's store)."""

    def __init__(self, host: str, say: Callable[[str], None],
                 publish: Callable[[str, str], None] | None = None,
                 enabled: bool = True) -> None:
        """``enabled`` False (no torch here): nothing is hosted, and the other nodes are
        told so (port 0), so their ranks get rankwise's store as ``MASTER_PORT``."""
        self._host = host
        self._enabled = enabled
        self._say = say
        self._publish = publish
        self._current: _OneStore | None = None
        self._told = threading.Event()
        #: set once a client reached a torch store of this job: plain torch ranks run
        self.used = threading.Event()

    def _knocked(self) -> None:
        self.used.set()
        if not self._told.is_set():
            self._told.set()
            self._say(PLAIN_TORCH_LINE)

    def port_for(self, attempt: int) -> int | None:
        """A fresh store for ``attempt`` (the last attempt's is closed); its port."""
        self.close()
        if self._enabled:
            self._current = _OneStore(self._host, self._knocked, self._say)
        port = self._current.port if self._current is not None else None
        if self._publish is not None:
            try:
                self._publish(f"{_KEY}{attempt}", str(port or 0))
            except DistError as exc:
                self._say(f"rankwise run: warning: could not tell the other nodes where "
                          f"torch's store is ({exc})")
        return port

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


class TorchStorePort:
    """Another node's view: the port node 0 published for an attempt (None if it did not
    say within ``timeout``: the workers then get rankwise's store as ``MASTER_PORT``)."""

    def __init__(self, read: Callable[[str, float], str | None], timeout: float,
                 say: Callable[[str], None]) -> None:
        self._read = read
        self._timeout = timeout
        self._say = say
        self.used = threading.Event()  #: never set here: node 0's launcher sees the knocks

    def port_for(self, attempt: int) -> int | None:
        text = self._read(f"{_KEY}{attempt}", self._timeout)
        if text is None:
            self._say("rankwise run: warning: node 0 did not say where torch's store is; "
                      "this node's ranks get rankwise's store as MASTER_PORT")
            return None
        return int(text) or None

    def close(self) -> None:
        pass


def _close(store: Store) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()


def torch_store_for(host: str, *, hosting: bool, several_nodes: bool, timeout: float,
                    client: Callable[[float], Store], say: Callable[[str], None]
                    ) -> TorchStoreHost | TorchStorePort:
    """This node's source of torch's store: hosted here on the node that hosts rankwise's
    store (published to the others when the job has several nodes), else read from it.
    ``client(t)``: a client of rankwise's store whose calls time out after ``t`` s."""
    def publish(key: str, value: str) -> None:
        store = client(min(timeout, 5.0))
        try:
            store.set(key, value)
        finally:
            _close(store)

    def read(key: str, wait: float) -> str | None:
        try:
            store = client(wait)
        except DistError:
            return None
        try:
            return store.get(key).decode()
        except DistTimeout:
            return None
        finally:
            _close(store)

    if hosting:
        return TorchStoreHost(host, say, publish if several_nodes else None,
                              enabled=torch_installed())
    return TorchStorePort(read, timeout, say)
