"""Every thread's innermost frame (``sys._current_frames``), read without the deadlock
CPython 3.11 has there.

Why: ``sys._current_frames()`` takes the runtime's thread-list lock and then makes frame
objects. An allocation there can start a garbage collection, the collection can free a
torch tensor, and torch releases the GIL while it frees one. A thread that starts or
ends at that moment takes the GIL and waits for the thread-list lock: the process
freezes, beyond any timeout (CPython gh-106883, fixed in 3.12 by holding the collector
off). Seen in CI: a thread-rank answering "where are you?" while its peer's thread
ended. So the collector is held off here too, as CPython now does.
"""

from __future__ import annotations

import gc
import sys
import threading
from types import FrameType

__all__ = ["current_frames"]

_lock = threading.Lock()  #: two readers at once must not re-enable the collector early


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the garbage collector off while it runs."""
    with _lock:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if enabled:
                gc.enable()
