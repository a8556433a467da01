"""What the launcher calls: start the live page on the node that hosts the store.

Why its own module: ``launch.job`` only needs "start it, tell me its address, stop it";
the store client, the poller and the server stay here.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from .collector import Collector
from .publisher import PAGE_KEY
from .server import LiveServer, parse_live_address

__all__ = ["LivePage", "start_page"]


class LivePage:
    """A running page: its collector's store client, poller and HTTP server."""

    def __init__(self, store: Any, collector: Collector, server: LiveServer) -> None:
        self._store = store
        self.collector = collector
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def close(self, linger: float = 0.0) -> None:
        """Read the ranks' last snapshots (a failure report published at exit), keep
        serving them ``linger`` seconds more, then stop."""
        self.collector.stop()
        try:
            self.collector.poll()
        except Exception:  # noqa: BLE001, S110 - the store may be gone already
            pass
        if linger > 0:
            time.sleep(linger)
        self.server.close()
        self._store.close()


def start_page(address: str, store_host: str, store_port: int, token: str | None,
               world_size: int = 0) -> LivePage:
    """Serve the page on ``address`` (``HOST:PORT``; port 0: any free one), fed by the
    job's store at ``store_host:store_port``. Raises ``OSError`` / ``ValueError`` when it
    cannot (the launcher then runs the job without it)."""
    from ..store import TCPStore

    host, port = parse_live_address(address)
    store = TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=5),
                     token=token)
    try:
        store.set(PAGE_KEY, "1")  # the ranks of every node publish once they see it
        collector = Collector(store, world_size)
        server = LiveServer(collector, host, port, tokens=(token,) if token else ())
    except BaseException:
        store.close()
        raise
    collector.start()
    server.start()
    return LivePage(store, collector, server)
