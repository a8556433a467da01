"""Is a peer process on this host still alive? One pidfd per peer, polled.

Why pidfds: a pid can be reused once its process is reaped, but a pidfd keeps naming
the process it was opened for, and polls readable once that process has exited (zombies
included), so a dead peer is seen within one poll however the launcher reaps it. Where
``pidfd_open`` is refused (old kernel, seccomp) a signal probe stands in. Used by the
collective engine's rounds and by the p2p rings (``rankwise.transport.shm``).
"""

from __future__ import annotations

import os
import select

__all__ = ["PidWatch"]


class PidWatch:
    """Liveness of peers by key (a rank); open the pidfd on first ask, close at the end."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def alive(self, key: int, pid: int) -> bool:
        """False once the process ``pid`` (first seen for ``key``) has exited; a pid of 0
        or less means "not attached yet" and counts as alive."""
        fd = self._fds.get(key)
        if fd is None:
            if pid <= 0:
                return True
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return False
                except OSError:
                    pass
                return True
            self._fds[key] = fd
        readable, _, _ = select.select([fd], [], [], 0)
        return not readable

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
