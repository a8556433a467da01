"""Run a function on N real processes (one rank each) with a hard deadline.

Shared by the DDP tests, on ``_procs.run_ranks``: each rank joins a process group (of
the backend asked for) on a fresh port, runs ``fn(rank, world_size, *args)`` and sends
back its result or its traceback. The parent never waits longer than ``timeout``: stuck
ranks dump their stacks and are killed, and the test fails saying which.

``backend`` picks whose collectives DDP uses: ``"rankwise"`` (the project's core) or
``"torch"`` (torch.distributed on gloo, the oracle). ``default_backend()`` is rankwise
when its core is importable, else torch so the DDP layer stays testable on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _procs
import pytest
from _procs import free_port

from rankwise.errors import DistTimeout

pytestmark = pytest.mark.procs


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


def _entry(rank: int, world_size: int, fn: Callable[..., Any], port: int, backend: str,
           args: tuple[Any, ...]) -> Any:
    import torch

    torch.set_num_threads(1)
    dist = init_backend(backend, rank, world_size, port)
    value = fn(rank, world_size, *args)
    dist.destroy_process_group()
    return value


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
    chosen = backend or default_backend()
    try:
        results = _procs.run_ranks(_entry, world_size, args=(fn, free_port(), chosen, args),
                                   timeout=timeout, init=False)
    except DistTimeout as exc:
        pytest.fail(f"ranks gave no result within {timeout}s (hung): {exc}")
    missing = [r.rank for r in results if r.raised("Died")]
    if missing:
        pytest.fail(f"ranks {missing} gave no result within {timeout}s (crashed)")
    failed = {r.rank: r.traceback for r in results if r.error_type is not None}
    if failed and not expect_failure:
        pytest.fail("".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
    return [r.traceback if r.error_type is not None else r.value for r in results]


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_harness_reports_each_rank() -> None:
    values = run_ranks(_raise_on_rank_one, 2, backend="torch", expect_failure=True)
    assert values[0] == 0
    assert "boom on purpose" in values[1]
