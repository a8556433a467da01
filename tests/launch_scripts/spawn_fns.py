"""Functions run by rankwise.spawn in the tests (importable by spawned children)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def write_rank(i: int, out: str) -> None:
    Path(out, f"rank_{i}").write_text(str(os.getpid()))


def fail(i: int, mode: str, out: str) -> None:
    Path(out, f"pid_{i}").write_text(str(os.getpid()))
    if i == 1:
        if mode == "raise":
            raise ValueError(f"spawned rank {i} broke")
        if mode == "exit":
            sys.exit(4)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # killed by spawn's teardown
