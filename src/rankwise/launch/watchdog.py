"""The launcher's watchdog: when the launcher ends, however it ends, so does its job.

Why a separate process: ``PR_SET_PDEATHSIG`` kills the workers when a SIGKILLed launcher
dies, but not what the workers started (data-loader processes, shells, servers): those are
re-parented to init and live on, holding ports, GPUs and files. And a process that left
its worker's process group (``setsid``) escapes ``killpg`` even in an orderly teardown.

So the launcher starts this small process (stdlib only, its own session so a terminal's
Ctrl-C does not reach it first) with a pipe on its stdin and a per-job marker that every
worker inherits in its environment (``RANKWISE_JOB_MARKER``). The launcher never writes to
the pipe; when the launcher exits or is killed, the kernel closes it, the read below
returns, and the watchdog SIGKILLs every process of this user whose environment carries
the marker, until none is left (bounded). It runs as a plain script (``python -I
watchdog.py MARKER``), so it starts fast and never imports the package.
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["MARKER_ENV", "kill_marked", "marked_processes"]

MARKER_ENV = "RANKWISE_JOB_MARKER"


def marked_processes(marker: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def kill_marked(marker: str, within: float = 10.0) -> list[int]:
    """SIGKILL the marked processes until two scans in a row find none (a process forking
    while we scan is caught by the next one); returns every pid signalled."""
    deadline = time.monotonic() + within
    killed: list[int] = []
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        pids = marked_processes(marker)
        quiet = 0 if pids else quiet + 1
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        if pids:
            time.sleep(0.05)  # let the kernel reap them before the next scan
    return killed


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1]:
        print("usage: watchdog.py MARKER (stdin: a pipe from the launcher)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end tells us to act
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    kill_marked(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
