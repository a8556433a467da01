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
the marker, until none is left (bounded), then removes the job's scratch directory (the
launcher's own ``finally`` never runs when it is SIGKILLed, and each killed job would
leave a ``rankwise-run-*`` directory in the temp folder). It runs as a plain script
(``python -I watchdog.py MARKER [RUN_DIR]``), so it starts fast and never imports the
package.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

__all__ = ["MARKER_ENV", "RUN_DIR_PREFIX", "kill_marked", "marked_processes", "remove_run_dir"]

MARKER_ENV = "RANKWISE_JOB_MARKER"
#: the launcher's scratch directories are named so; the watchdog removes nothing else
RUN_DIR_PREFIX = "rankwise-run-"


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


def remove_run_dir(path: str) -> bool:
    """Remove the launcher's scratch directory ``path``; refuse anything not named like
    one (a wrong argument must never delete a user's directory). True if it was removed."""
    if not os.path.basename(os.path.normpath(path)).startswith(RUN_DIR_PREFIX) \
            or os.path.islink(path) or not os.path.isdir(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not argv[1]:
        print("usage: watchdog.py MARKER [RUN_DIR] (stdin: a pipe from the launcher)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end tells us to act
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    kill_marked(argv[1])
    if len(argv) == 3:  # after the kill: no worker writes into it any more
        remove_run_dir(argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
