"""Run a function on N real processes (one rank each) with a hard deadline.

Shared by the DDP tests. Ranks are spawned (not forked: torch and threads), each joins a
process group on a fresh port, runs ``fn(rank, world_size, *args)`` and sends back its
result or its traceback. The parent never waits longer than ``timeout``: stuck ranks
dump their stacks (faulthandler) and are killed, and the test fails saying which.

``backend`` picks whose collectives DDP uses: ``"rankwise"`` (the project's core) or
``"torch"`` (torch.distributed on gloo, the oracle). ``default_backend()`` is rankwise
when its core is importable, else torch so the DDP layer stays testable on its own.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def core_available() -> bool:
    try:
        import rankwise
    except Exception:  # noqa: BLE001 - a half-written core counts as absent
        return False
    return all(hasattr(rankwise, n) for n in ("init_process_group", "all_reduce", "Work"))


def default_backend() -> str:
    return "rankwise" if core_available() else "torch"


def init_backend(backend: str, rank: int, world_size: int, port: int) -> Any:
    """Join the group and point rankwise.nn at it; returns the dist module."""
    from rankwise.nn import _comm

    address = f"tcp://127.0.0.1:{port}"
    if backend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
        _comm.use_comm(dist)
        return dist
    import rankwise

    rankwise.init_process_group("tcp", init_method=address, rank=rank, world_size=world_size)
    _comm.use_comm(None)
    return rankwise


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
) -> None:
    faulthandler.dump_traceback_later(max(timeout - 3, 1), exit=False)
    try:
        import torch

        torch.set_num_threads(1)
        dist = init_backend(backend, rank, world_size, port)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        sys.exit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 60.0,
    expect_failure: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return each rank's value (or traceback text).

    Without ``expect_failure`` any rank that raises fails the test with its traceback;
    with it, the returned list holds traceback strings for the ranks that raised.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    chosen = backend or default_backend()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, chosen, args, results, timeout),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcome[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = sorted(set(range(world_size)) - set(outcome))
    if missing:
        pytest.fail(f"ranks {missing} gave no result within {timeout}s (hung or crashed)")
    failed = {r: v for r, (ok, v) in outcome.items() if not ok}
    if failed and not expect_failure:
        pytest.fail("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
    return [outcome[r][1] for r in range(world_size)]


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_harness_reports_each_rank() -> None:
    values = run_ranks(_raise_on_rank_one, 2, backend="torch", expect_failure=True)
    assert values[0] == 0
    assert "boom on purpose" in values[1]
