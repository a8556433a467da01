"""Kernel-side liveness for TCP sockets: keepalive probes and ``TCP_USER_TIMEOUT``.

Why: the heartbeats (``core.heartbeat``) watch one peer per rank; these options are the
backstop on every connection, so a connection to a host that vanished errors out on its
own instead of holding unacknowledged data, or sitting idle, forever. Both are set to
twice the heartbeat timeout, so the heartbeat's more precise report comes first.
"""

from __future__ import annotations

import socket

from .. import settings

__all__ = ["DEFAULT_TIMEOUT", "LAUNCHED_HEARTBEAT_TIMEOUT", "NEWS_ENV", "heartbeat_timeout",
           "keep_alive"]

#: seconds of silence before a peer is reported (docs/heartbeats.md says why 15)
DEFAULT_TIMEOUT = 15.0
_ENV = "RANKWISE_HEARTBEAT_TIMEOUT"
#: the ranks' heartbeat timeout under ``rankwise run`` unless RANKWISE_HEARTBEAT_TIMEOUT is set
#: (the launchers' node beats watch the nodes: docs/heartbeats.md)
LAUNCHED_HEARTBEAT_TIMEOUT = 60.0
#: ``<fd>:<inode>`` of the pipe the launcher writes a lost node's news to (``launch.agent``)
NEWS_ENV = "RANKWISE_NODE_NEWS"


def heartbeat_timeout() -> float:
    """``RANKWISE_HEARTBEAT_TIMEOUT`` in seconds; 0 turns heartbeats off; a bad value is
    refused at once (a typo must not silently disable failure detection)."""
    return settings.number(_ENV, DEFAULT_TIMEOUT)


def keep_alive(sock: socket.socket, timeout: float | None = None) -> None:
    """Probe an idle connection after ``timeout`` s, give up after 3 unanswered probes
    ``timeout / 3`` s apart, and fail a send unacknowledged for ``2 * timeout`` s
    (``timeout``: the heartbeat timeout; 0 leaves the socket as it is). Options this
    platform lacks are skipped."""
    timeout = heartbeat_timeout() if timeout is None else timeout
    if timeout <= 0:
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", timeout), ("TCP_KEEPINTVL", timeout / 3),
                        ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 2000 * timeout)):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), max(1, int(value))))
    for level, opt, value in options:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass
