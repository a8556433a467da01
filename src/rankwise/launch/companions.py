"""What runs beside one node's workers: the watchdog process and the live page.

Why apart from ``launch.job``: these are started and stopped around a job, and each
failure of theirs is a warning, never the job's failure; ``job`` only says when.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from .. import settings
from ..errors import DistError

__all__ = ["live_linger", "say", "start_live", "start_watchdog", "stop_watchdog"]


def say(text: str) -> None:
    """A launcher's line: on stderr, after whatever the workers' stdout still holds."""
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def start_watchdog(marker: str, run_dir: str) -> subprocess.Popen[bytes] | None:
    """The process that kills whatever of the job outlives the launcher and removes
    ``run_dir`` (``watchdog.py``)."""
    if not sys.platform.startswith("linux"):
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
    try:
        return subprocess.Popen([sys.executable, "-I", script, marker, run_dir],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        say(f"rankwise run: warning: could not start the watchdog ({exc}); processes the "
            "workers start may outlive a killed launcher")
        return None


def stop_watchdog(watchdog: subprocess.Popen[bytes] | None) -> None:
    """Close its pipe (it then kills anything of the job still running) and wait for it."""
    if watchdog is None:
        return
    assert watchdog.stdin is not None
    watchdog.stdin.close()
    try:
        watchdog.wait(15.0)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def start_live(live: str | None, master_addr: str, port: int, token: str | None,
               ranks: int) -> Any | None:
    """The live page (``rankwise.live``) on the node that hosts the store, its address
    printed (``ranks``: how many the page expects, 0 when elastic); None when turned off
    (``--no-live``) or when it cannot start."""
    if not live:
        return None
    from ..live.serve import start_page

    try:
        page = start_page(live, master_addr, port, token, ranks)
    except (OSError, ValueError, DistError) as exc:
        say(f"rankwise run: the live page could not start on {live} ({exc}); "
            "running without it")
        return None
    say(f"rankwise run: live page at {page.url}")
    return page


def live_linger() -> float:
    """``RANKWISE_LIVE_LINGER``: seconds the live page stays up after the job ended."""
    return settings.number("RANKWISE_LIVE_LINGER")
