"""Hold each new worker stopped until the node's last one is spawned, then release all.

Why: spawning is serial and every worker starts importing at once, so with more workers
than CPUs the spawn loop shares the cores with the workers already running, and the first
ranks reach ``init_process_group`` seconds before the last and wait there (64 ranks on 2
cores: 2.9 s of spawning, early ranks up to 3.5 s in init). Held, they cost the loop
nothing; released together they start side by side and arrive within about half a second.
A signal rather than a gate inside the child: ``Popen`` returns only once the child has
exec'd the user's program, which nothing of ours runs in. Numbers: docs/scale.md.
"""

from __future__ import annotations

import os
import signal

__all__ = ["StartGate"]


class StartGate:
    """SIGSTOPs each worker's process group as it is spawned; ``release`` SIGCONTs them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held: list[int] = []

    def hold(self, pid: int) -> None:
        """Stop the process group ``pid`` leads (a worker just spawned, in its own group)."""
        if self.enabled and _signal(pid, signal.SIGSTOP):
            self._held.append(pid)

    def release(self) -> None:
        """Let every held worker go on (at once: one signal each, nothing in between)."""
        held, self._held = self._held, []
        for pid in held:
            _signal(pid, signal.SIGCONT)


def _signal(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # gone already: nothing to hold
        return False
    return True
