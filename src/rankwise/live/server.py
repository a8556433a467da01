"""The live page's HTTP server: standard library only, GET on fixed routes, token required.

Why so narrow: the page shows call sites, host names, pids and stacks of a running job,
so nobody without the token sees anything (401 without one, 403 with a wrong one, before
any route is looked at); nothing sent to it is run or stored (GET and HEAD only, four
fixed paths, the one parameter is a rank number); it binds 127.0.0.1 unless told
otherwise. Requests read the collector's last poll, so a busy page does not load the job.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .collector import Collector
from .page import render_page

__all__ = ["LiveServer", "parse_live_address"]

_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # the token is in the page's address
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; connect-src 'self'; "
                               "img-src data:; form-action 'none'; frame-ancestors 'none'",
}


def parse_live_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``HOST`` (port 0: any free one) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "0"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--live must be HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--live port must be 0..65535, got {number}")
    return host.strip("[]") or "127.0.0.1", number


class LiveServer:
    """Serves ``collector``'s data on ``host:port`` in a daemon thread."""

    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0,
                 tokens: tuple[str, ...] = ()) -> None:
        self.token = secrets.token_urlsafe(18)  #: printed at start; the job's also works
        accepted = tuple(t for t in (self.token, *tokens) if t)
        handler = type("Handler", (_Handler,), {"collector": collector, "tokens": accepted})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="rankwise-live-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/?token={self.token}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    collector: Collector
    tokens: tuple[str, ...]
    server_version = "rankwise-live"
    sys_version = ""
    timeout = 10  #: seconds a connection may sit idle: a silent client cannot hold a thread

    def log_message(self, format: str, *args: Any) -> None:
        return  # the job's console is the user's: no access log there

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        denied = self._denied(query)
        if denied:
            self._send(denied[0], {"error": denied[1]})
            return
        if url.path == "/":
            self._send(200, render_page(self.collector.data()), "text/html; charset=utf-8")
        elif url.path == "/api/job":
            self._send(200, self.collector.data())
        elif url.path == "/api/stacks":
            rank = _rank(query, self.collector.world_size)
            if rank is None:
                self._send(400, {"error": "rank=N, a rank of this job"})
            else:
                self._send(200, self.collector.stacks(rank))
        elif url.path == "/healthz":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": "no such page"})

    def _denied(self, query: dict[str, list[str]]) -> tuple[int, str] | None:
        given = query.get("token", [""])[0]
        auth = self.headers.get("Authorization", "")
        if not given and auth.startswith("Bearer "):
            given = auth[len("Bearer "):].strip()
        if not given:
            return 401, "this page needs the token rankwise run printed (?token=...)"
        if not any(hmac.compare_digest(given.encode(), t.encode()) for t in self.tokens):
            return 403, "wrong token"
        return None

    def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
        raw = body.encode() if isinstance(body, str) else json.dumps(body, default=str).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        for k, v in _HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)


def _rank(query: dict[str, list[str]], world: int) -> int | None:
    text = query.get("rank", [""])[0]
    if not text.isdigit() or int(text) >= max(world, 1):
        return None
    return int(text)
