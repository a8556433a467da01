"""N ranks as threads of one process, over the in-memory transport.

Why: the router, the fingerprint checks and every collective algorithm run here through
the public API exactly as in a real job, but without sockets, processes or a store, so
a test takes milliseconds (torchft tests its process groups with ranks as threads the
same way). Each thread gets its own world (``api.world.set_thread_world``).

Limits: the default group only (no ``new_group``: there is no store), no ``async_op``
(the async worker is one per process and would serialize the ranks' calls), and the
message engine only. Every run is bounded: a rank still running at ``timeout`` fails the
run with the ranks that did not finish named.

>>> results = run_threads(lambda rank, n: rank * 2, 3)   # -> [0, 2, 4]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..api.world import World, set_thread_world
from ..core.communicator import Communicator
from ..core.group import ProcessGroup
from ..core.work import stop_worker
from ..diagnosis.recorders import attach_recorders
from ..transport.memory import MemoryHub

__all__ = ["ThreadRankError", "run_threads"]

T = TypeVar("T")


class ThreadRankError(AssertionError):
    """A thread-rank raised or overran the run's timeout; ``errors`` has each rank's."""

    def __init__(self, message: str, errors: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


def _world(rank: int, n: int, hub: MemoryHub, timeout: float) -> World:
    comm = Communicator(rank, n, hub.transports[rank])
    attach_recorders(comm)
    group = ProcessGroup(comm, 0, list(range(n)), timeout, "memory",
                         "the default group (WORLD)")
    world = World(comm, group, None, None, "memory", timeout)
    world.register(group)
    comm.site_lookup = world.site_lookup
    return world


def run_threads(fn: Callable[[int, int], T], n: int, timeout: float = 20.0,
                op_timeout: float = 10.0) -> list[T]:
    """Run ``fn(rank, n)`` on n thread-ranks; return their results in rank order, or
    raise ``ThreadRankError`` naming every rank that raised or did not finish."""
    hub = MemoryHub(n)
    worlds = [_world(r, n, hub, op_timeout) for r in range(n)]
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        set_thread_world(worlds[rank])
        # this thread is the rank's "user code" (who-is-where reads its stack)
        worlds[rank].comm.user_thread = threading.get_ident()
        try:
            results[rank] = fn(rank, n)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            worlds[rank].comm.router.fail_all(exc)  # as a dying process would: peers learn
            hub.transports[rank].kill()
        finally:
            set_thread_world(None)

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    for w in worlds:
        w.comm.closed = True
        w.comm.transport.close()
        stop_worker(0.0, owner=w.comm)  # its async worker (one per thread-rank)
    if stuck:
        errors.update({r: TimeoutError(f"still running after {timeout}s") for r in stuck})
    if errors:
        lines = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())]
        raise ThreadRankError("thread-ranks failed:\n" + "\n".join(lines), errors)
    return [results[r] for r in range(n)]
