"""Engine conformance: one table every engine must pass, in-process, ranks as threads.

``check_engine(make_engine)`` builds a fresh job of thread-ranks per case over the memory
transport (the control plane is rankwise's own, in-process), gives its default group the
engine ``make_engine(group, store, timeout)`` returns (called on every rank's thread, as
engine creation is collective), and runs through the public API: every op x dtype x
reduce op against numpy and async calls (``Work``), then a mismatch, a peer that leaves,
and a passed deadline (sync and async), each of which must reach every waiting rank as the
right public exception. The checker raises
``AssertionError`` naming the first case that failed (the model: trio's
``check_two_way_stream``, torchft's one table of collectives for every implementation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api import collectives as C
from ..api.world import World, set_thread_world
from ..core.communicator import Communicator
from ..core.group import ProcessGroup
from ..core.work import Work, stop_worker
from ..engines.base import Caps, Engine
from ..errors import CollectiveMismatch, DistTimeout, PeerFailure
from ..store.hash import HashStore
from ..transport.memory import MemoryHub
from ..wire.buffers import ReduceOp

__all__ = ["DTYPES", "OPS", "EngineMaker", "check_engine"]

#: (group, store, timeout) -> the engine of that group on this rank (collective)
EngineMaker = Callable[[ProcessGroup, Any, float], Engine]

DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
       "reduce_scatter", "all_to_all", "barrier")
_REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
_NUMPY: dict[str, Callable[..., Any]] = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max, "AVG": np.mean}
N = 4  #: elements per rank and part


@dataclass
class _Job:
    worlds: list[World]
    hub: MemoryHub


def _job(size: int, timeout: float) -> _Job:
    hub = MemoryHub(size)
    worlds = []
    for rank in range(size):
        comm = Communicator(rank, size, hub.transports[rank])
        group = ProcessGroup(comm, 0, list(range(size)), timeout, "conformance",
                             "the default group (WORLD)")
        world = World(comm, group, None, None, "conformance", timeout)
        world.register(group)
        comm.site_lookup = world.site_lookup
        worlds.append(world)
    return _Job(worlds, hub)


def _run(make_engine: EngineMaker, size: int, timeout: float,
         body: Callable[[int, World], Any], limit: float) -> dict[int, Any]:
    """``body(rank, world)`` on every thread-rank after the engine is made; the value or
    the exception of each rank. A rank still running after ``limit`` s is an error."""
    job = _job(size, timeout)
    store = HashStore()
    out: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        world = job.worlds[rank]
        set_thread_world(world)
        world.comm.user_thread = threading.get_ident()
        try:
            group = world.default_group
            engine = group.engine = make_engine(group, store, timeout)
            if not isinstance(getattr(engine, "caps", None), Caps):  # the call path reads it
                raise TypeError(f"engine {engine.name!r} declares no Engine.caps "
                                "(engines.base.Caps; HOST_CAPS for a host engine)")
            out[rank] = body(rank, world)
        except BaseException as exc:  # noqa: BLE001 - judged by the case
            out[rank] = exc
        finally:
            set_thread_world(None)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True,
                                name=f"conformance-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    for world in job.worlds:
        world.comm.closed = True
        world.comm.transport.close()
        stop_worker(0.0, owner=world.comm)  # its async worker (one per thread-rank)
    for world in job.worlds:
        try:
            world.default_group.engine.close()
        except Exception:  # noqa: BLE001, S110 - a failed case may leave it half-made
            pass
    if stuck:
        raise AssertionError(f"ranks {stuck} still running after {limit}s: the engine hangs")
    return out


def _inputs(rank: int, dtype: str, parts: int = 1) -> Any:
    return (np.arange(N * parts) % 5 + rank + 1).astype(dtype)


def _one_op(op: str, dtype: str, rop: str, size: int) -> Callable[[int, World], bool]:
    """The body that runs ``op`` on every rank and checks the result against numpy."""
    root = size - 1
    everyone = [_inputs(r, dtype) for r in range(size)]
    reduced = _NUMPY[rop](np.stack(everyone), axis=0)

    def close(got: Any, want: Any) -> bool:
        return bool(np.allclose(got, np.asarray(want).astype(dtype), rtol=1e-5))

    def body(rank: int, world: World) -> bool:
        x = _inputs(rank, dtype)
        r = getattr(ReduceOp, rop)
        if op == "all_reduce":
            C.all_reduce(x, op=r)
            return close(x, reduced)
        if op == "broadcast":
            C.broadcast(x, src=root)
            return close(x, everyone[root])
        if op == "reduce":
            C.reduce(x, dst=root, op=r)
            return rank != root or close(x, reduced)
        if op == "all_gather":
            outs = [np.empty_like(x) for _ in range(size)]
            C.all_gather(outs, x)
            return all(close(o, e) for o, e in zip(outs, everyone, strict=True))
        if op == "gather":
            slots = [np.empty_like(x) for _ in range(size)] if rank == root else None
            C.gather(x, slots, dst=root)
            return slots is None or all(close(o, e) for o, e in zip(slots, everyone,
                                                                     strict=True))
        if op == "scatter":
            src = [(_inputs(root, dtype) * (k + 1)).astype(dtype) for k in range(size)] \
                if rank == root else None
            C.scatter(x, src, src=root)
            return close(x, _inputs(root, dtype) * (rank + 1))
        if op == "reduce_scatter":
            ins = [(_inputs(rank, dtype) + k).astype(dtype) for k in range(size)]
            C.reduce_scatter(x, ins, op=r)
            want = _NUMPY[rop](np.stack([_inputs(q, dtype) + rank for q in range(size)]),
                               axis=0)
            return close(x, want)
        if op == "all_to_all":
            ins = [(_inputs(rank, dtype) * 10 + k).astype(dtype) for k in range(size)]
            outs = [np.empty_like(x) for _ in range(size)]
            C.all_to_all(outs, ins)
            return all(close(outs[q], _inputs(q, dtype) * 10 + rank) for q in range(size))
        assert op == "barrier"
        C.barrier()
        return True

    return body


def _table(make_engine: EngineMaker, size: int, dtypes: Iterable[str], ops: Iterable[str],
           limit: float) -> None:
    cases = [(op, dt, rop) for op in ops for dt in dtypes
             for rop in (_REDUCE_OPS if op in ("all_reduce", "reduce", "reduce_scatter")
                         else ("SUM",))
             if not (rop == "AVG" and dt.startswith("int"))]
    bodies = [(case, _one_op(*case, size)) for case in cases]

    def body(rank: int, world: World) -> list[tuple[tuple[str, str, str], Any]]:
        results: list[tuple[tuple[str, str, str], Any]] = []
        for case, run in bodies:
            try:
                results.append((case, run(rank, world)))
            except Exception as exc:  # noqa: BLE001 - reported with its case
                results.append((case, exc))
                break  # the ranks no longer agree on what comes next
        return results

    for rank, got in _run(make_engine, size, 10.0, body, limit).items():
        failed = isinstance(got, BaseException)
        if failed:
            raise AssertionError(f"rank {rank}: {type(got).__name__}: {got}")
        for case, ok in got:
            if ok is not True:
                raise AssertionError(f"{'/'.join(case)} on rank {rank}: "
                                     + (f"{type(ok).__name__}: {ok}"
                                        if isinstance(ok, BaseException) else "wrong result"))


def _expect(results: dict[int, Any], ranks: Iterable[int], exc_type: type[BaseException],
            what: str, *needles: str) -> None:
    for rank in ranks:
        got = results[rank]
        right = isinstance(got, exc_type)
        if not right:
            raise AssertionError(f"{what}: rank {rank} should raise {exc_type.__name__}, got "
                                 f"{type(got).__name__}: {got}")
        for needle in needles:
            if needle not in str(got):
                raise AssertionError(f"{what}: rank {rank}'s {exc_type.__name__} does not "
                                     f"say {needle!r}: {got}")


def _all_reduce(x: Any, is_async: bool, op: ReduceOp = ReduceOp.SUM) -> None:
    """``all_reduce``, blocking or (``is_async``) as a ``Work`` waited on: either way the
    failure must come out of this call."""
    work = C.all_reduce(x, op=op, async_op=is_async)
    if work is not None:
        work.wait()


def _mismatch(make_engine: EngineMaker, size: int, limit: float, is_async: bool) -> None:
    def body(rank: int, world: World) -> None:
        _all_reduce(np.ones(N, np.float32), is_async,
                    ReduceOp.MAX if rank == 0 else ReduceOp.SUM)

    results = _run(make_engine, size, 10.0, body, limit)
    _expect(results, range(size), CollectiveMismatch,
            f"{_kind(is_async)}ranks calling different reductions",
            "collective mismatch", "MAX", "SUM")


def _peer_gone(make_engine: EngineMaker, size: int, limit: float, is_async: bool) -> None:
    gone = size - 1

    def body(rank: int, world: World) -> None:
        if rank == gone:  # leaves without the call the others make
            world.comm.goodbye("left the conformance check early")
            world.default_group.engine.close()
            return
        _all_reduce(np.ones(N, np.float32), is_async)

    results = _run(make_engine, size, 10.0, body, limit)
    _expect(results, range(gone), PeerFailure, f"{_kind(is_async)}a peer that left",
            f"rank {gone}")


def _deadline(make_engine: EngineMaker, size: int, timeout: float, limit: float,
              is_async: bool) -> None:
    done = threading.Event()

    def body(rank: int, world: World) -> None:
        if rank == size - 1:  # never makes the call, until the others gave up
            done.wait(limit)
            return
        try:
            _all_reduce(np.ones(N, np.float32), is_async)
        finally:
            done.set()

    results = _run(make_engine, size, timeout, body, limit)
    _expect(results, range(size - 1), DistTimeout,
            f"{_kind(is_async)}a call a peer never makes", "timed out after")


def _kind(is_async: bool) -> str:
    return "async_op=True: " if is_async else ""


def _async(make_engine: EngineMaker, size: int, limit: float) -> None:
    """Two async calls in flight, then a blocking one: ``wait`` returns True, the results
    are there after it, ``is_completed`` says so, and the blocking call runs after both."""
    def body(rank: int, world: World) -> bool:
        a, b = _inputs(rank, "float32"), _inputs(rank, "int64")
        handles = [C.all_reduce(a, async_op=True), C.broadcast(b, src=size - 1, async_op=True)]
        works = [w for w in handles if isinstance(w, Work)]
        if len(works) != len(handles):
            return False
        waited = [w.wait() for w in works]
        c = np.full(N, rank + 1, np.float64)
        C.all_reduce(c, op=ReduceOp.MAX)
        return (waited == [True, True] and all(w.is_completed() for w in works)
                and bool(np.allclose(a, sum(_inputs(r, "float32") for r in range(size))))
                and bool(np.array_equal(b, _inputs(size - 1, "int64")))
                and bool(np.all(c == size)))

    for rank, ok in _run(make_engine, size, 10.0, body, limit).items():
        if ok is not True:
            raise AssertionError(f"async calls on rank {rank}: " + (
                f"{type(ok).__name__}: {ok}" if isinstance(ok, BaseException)
                else "wrong result or state after wait()"))


def check_engine(make_engine: EngineMaker, *, size: int = 2, dtypes: Iterable[str] = DTYPES,
                 ops: Iterable[str] = OPS, failures: bool = True, timeout: float = 1.0,
                 limit: float = 60.0) -> None:
    """Check the engine ``make_engine`` makes against the conformance table, then (with
    ``failures``) a mismatch, a peer that leaves and a passed deadline (``timeout``
    seconds per call), each also as an ``async_op=True`` call whose ``Work.wait`` raises.
    Raises ``AssertionError`` naming the first case it fails."""
    _table(make_engine, size, list(dtypes), list(ops), limit)
    _async(make_engine, size, limit)
    for is_async in (False, True) if failures else ():
        _mismatch(make_engine, size, limit, is_async)
        _peer_gone(make_engine, size, limit, is_async)
        _deadline(make_engine, size, timeout, limit, is_async)
