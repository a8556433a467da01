"""Real multi-process runs with a hard bound (see ``rankwise.testing``)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import settings
from ..errors import DistTimeout

__all__ = ["RankResult", "free_port", "run_ranks"]


def _context() -> Any:
    """How ranks start: ``forkserver`` with numpy, rankwise and (where installed) torch
    imported once in the server, or ``spawn`` (``RANKWISE_TEST_START=spawn``). A spawned
    rank of a torch test imported torch again (~1.6 s of CPU each, hundreds of ranks per
    suite run); a forked one starts in milliseconds, and still a fresh process per run."""
    method = settings.choice("RANKWISE_TEST_START")
    if method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    preload = ["numpy", "rankwise"]
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            preload.append("torch")
    except (ImportError, ValueError):
        pass
    ctx.set_forkserver_preload(preload)
    return ctx


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_handed_out: set[int] = set()
_pick = random.Random(os.getpid() ^ time.monotonic_ns())  # noqa: S311 - ports, no secret


def free_port() -> int:
    """A port that was free a moment ago on loopback, chosen below the kernel's ephemeral
    range: a port from that range, once released, can be taken by any socket bound to
    port 0 or any outgoing connection before its user binds it (CI saw gloo's clients
    reach a rankwise listener that had taken the port a test handed torch)."""
    floor = _ephemeral_floor()
    if floor > 20000:
        for _ in range(200):
            port = _pick.randrange(15000, floor)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None  #: class name of the exception, None on success
    error_types: list[str] = field(default_factory=list)  #: the exception's MRO names
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    elapsed: float = 0.0  #: seconds from start of fn to its end (or its exception)

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0

    def raised(self, name: str) -> bool:
        return name in self.error_types


#: seconds past the parent's deadline after which a child ends itself (its parent, which
#: kills it at the deadline, must have died)
ORPHAN_GRACE = 15.0


def _exit_at(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))
    os._exit(1)


def _child(fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...],
           port: int, init: bool, init_kwargs: dict[str, Any], env: dict[str, str],
           deadline: float, results: Any, parent_env: dict[str, str] | None = None) -> None:
    if parent_env is not None:  # a forkserver child has the server's environment
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    # dump every thread's stack a second before the parent's deadline (the same clock:
    # CLOCK_MONOTONIC is system-wide), so a hang shows where it hung; the parent then
    # kills what still runs. Timed from the child's own start, the dump came after the
    # parent had killed it (a spawned child takes seconds to get here on a loaded
    # machine). A child whose parent died goes on its own, a little later.
    faulthandler.dump_traceback_later(max(1.0, deadline - 1.0 - time.monotonic()))
    threading.Thread(target=_exit_at, args=(deadline + ORPHAN_GRACE,), daemon=True).start()
    import rankwise

    if settings.choice("RANKWISE_ENGINE").startswith("torch"):
        # ``elapsed`` bounds how fast rankwise reacts; importing torch (seconds on a
        # loaded machine) is not part of that
        import torch  # noqa: F401
    start = time.monotonic()
    result = RankResult(rank)
    try:
        if init:
            kwargs: dict[str, Any] = {"backend": "tcp", "init_method": f"tcp://127.0.0.1:{port}",
                      "rank": rank, "world_size": world_size, "timeout": 30.0}
            kwargs.update(init_kwargs)
            rankwise.init_process_group(**kwargs)
        result.value = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - report everything, SystemExit too
        result.error_type = type(exc).__name__
        result.error_types = [c.__name__ for c in type(exc).__mro__]
        result.message = str(exc)
        result.traceback = traceback.format_exc()
    result.elapsed = time.monotonic() - start
    try:
        results.put(result)
    except Exception as exc:  # noqa: BLE001 - unpicklable return value
        results.put(RankResult(rank, None, "PicklingError", ["PicklingError"], repr(exc)))
    if init and rankwise.is_initialized():
        try:
            rankwise.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - the result is already reported
            pass
    sys.stdout.flush()


def run_ranks(fn: Callable[..., Any], world_size: int, *, args: tuple[Any, ...] = (),
              timeout: float = 60.0, init: bool = True,
              init_kwargs: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    ``fn`` must be importable (a module-level function). ``env`` entries are set in every
    child; per-rank values can be given as ``{"VAR": "a,b,c"}`` with ``env_per_rank``
    semantics left to ``fn`` itself. Raises ``DistTimeout`` (after killing every child)
    if the run exceeds ``timeout`` seconds.
    """
    ctx = _context()
    parent_env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    results: Any = ctx.Queue()
    port = free_port()
    deadline = time.monotonic() + timeout
    procs = [ctx.Process(target=_child, name=f"rank{r}",
                         args=(fn, r, world_size, args, port, init, init_kwargs or {},
                               env or {}, deadline, results, parent_env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, RankResult] = {}
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                res = results.get(timeout=min(remaining, 0.5))
                collected[res.rank] = res
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    # everyone exited; drain what is left, then stop waiting
                    try:
                        while True:
                            res = results.get(timeout=0.2)
                            collected[res.rank] = res
                    except queue.Empty:
                        break
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        overran = [p.name for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    if overran:
        raise DistTimeout(f"ranks {overran} still running after {timeout:.0f}s; killed them "
                          "(their stacks were dumped to stderr)")
    out = []
    for r, p in enumerate(procs):
        res = collected.get(r) or RankResult(r, error_type="Died", error_types=["Died"],
                                              message=f"exited with {p.exitcode} "
                                                      "without reporting")
        res.exitcode = p.exitcode
        out.append(res)
    return out
