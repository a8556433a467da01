"""Which socket errors mean "try again" and which mean this host ran out of something.

Why: a rank that retried every connection error as "the peer is not listening yet" spun
silently until the init timeout when it was out of file descriptors (``EMFILE``), while gloo
raised "Too many open files" at once. Only the errors a peer that is still starting (or a
link that is still coming up) causes are retried; running out of a local resource raises on
the rank that ran out, naming the resource and its limit.
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["exhausted", "retryable"]

#: what a connect to a peer that is not listening yet, or a link that flaps, raises
_RETRYABLE = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
                        errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                        errno.EHOSTDOWN, errno.ENETDOWN, errno.EAGAIN, errno.EINTR})


def retryable(exc: OSError) -> bool:
    """True for a connect error worth retrying (refused, reset, timed out, unreachable)."""
    return isinstance(exc, TimeoutError) or exc.errno in _RETRYABLE


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return " ".join(fh.read().split())
    except OSError:
        return "?"  # reading it takes a descriptor too, which may be what ran out


def _open_descriptors() -> str:
    try:
        return f"{len(os.listdir('/proc/self/fd'))} open"
    except OSError:
        return "every one in use"  # listing them takes a descriptor too


def exhausted(exc: OSError) -> str:
    """What local resource ``exc`` says ran out, with its limit ("" when it is not one)."""
    if exc.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"too many open files: RLIMIT_NOFILE is {soft} (hard limit {hard}), "
                f"{_open_descriptors()}; raise it (`ulimit -n`) or open fewer")
    if exc.errno == errno.ENFILE:
        return ("the system's open-file table is full: fs.file-max is "
                f"{_read('/proc/sys/fs/file-max')} (`sysctl fs.file-max`)")
    if exc.errno == errno.ENOMEM:
        return "out of kernel memory for a socket (ENOMEM): the host is short of memory"
    if exc.errno == errno.ENOBUFS:
        return ("no buffer space for a socket (ENOBUFS): net.ipv4.tcp_mem is "
                f"{_read('/proc/sys/net/ipv4/tcp_mem')} pages")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ("no local port left to connect from (EADDRNOTAVAIL): "
                f"net.ipv4.ip_local_port_range is {_read('/proc/sys/net/ipv4/ip_local_port_range')}")
    return ""
