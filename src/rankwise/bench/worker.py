"""The measuring half of ``rankwise bench``: what every rank of the benchmark job runs.

Why all libraries live in the same processes: a ratio between two libraries measured in
two different runs mixes in whatever else the machine did between them (on a shared 2-core
box that easily reaches +-30%).  Here each rank initializes rankwise, torch's gloo and, under
``mpirun``, MPI side by side, and every (op, size) cell times them in alternating rounds on
the *same* buffers: a slow spell of the machine lands on every library, and round ``i`` of
one library pairs with round ``i`` of the others, so a single round's ratio is meaningful.

Each rankwise engine is its own pass: the process joins a fresh rankwise job per engine
(``RANKWISE_ENGINE`` set before ``init_process_group``, a fresh store per pass), while
gloo and MPI stay up for the whole run and are timed again in every pass, so each
rankwise-vs-X ratio comes from one pass of one run.

Nothing here formats or plots: rank 0 returns plain numbers (see ``_bench_report``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import numpy as np

from .. import settings
from .patterns import Pattern, timed_batch

__all__ = ["OPS", "WorkerConfig", "bus_factor", "run_worker"]

#: every op the bench knows, in the order a report lists them
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier")
_MAX_ITERS = 10_000
_INIT_TIMEOUT_S = 300.0


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = size / time * factor.

    Why this and not plain size/time: it normalizes each op to the bytes a link must carry
    in an optimal algorithm, so one number compares ops and world sizes (PERFORMANCE.md of
    nccl-tests).  0 for barrier: it moves no payload.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    return 0.0


@dataclass(frozen=True)
class WorkerConfig:
    """What one rank needs to know; built from the command line by ``bench.py``."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    engines: tuple[str, ...]
    rounds: int
    iters: int | None  # None: adaptive, each round about ``round_time`` seconds
    round_time: float
    gloo: bool
    mpi: bool
    pattern: Pattern = field(default_factory=Pattern)


@dataclass
class _Buffers:
    """One cell's buffers; every library reads and writes the same memory.

    ``inp``/``out`` are what the library receives: torch tensors when torch is present
    (what users pass), else the numpy arrays themselves; ``np_inp``/``np_out`` are the
    numpy views MPI needs.
    """

    np_inp: np.ndarray[Any, Any]
    np_out: np.ndarray[Any, Any]
    inp: Any
    out: Any
    nbytes: int  # the row's size, nccl-tests' convention (the whole gathered buffer)


def _buffers(op: str, size: int, n: int, rank: int, use_torch: bool) -> _Buffers:
    numel = max(1, size // 4)
    rng = np.random.default_rng(rank)
    if op in ("all_gather", "reduce_scatter"):
        piece = max(1, numel // n)  # per-rank piece; the row's size is the whole buffer
        small = rng.random(piece, dtype=np.float32)
        big = rng.random(piece * n, dtype=np.float32)
        inp, out = (small, big) if op == "all_gather" else (big, small)
        nbytes = piece * n * 4
    elif op == "all_to_all":
        numel = max(1, numel // n) * n  # equal split: every peer gets numel / n elements
        inp, out = rng.random(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
        nbytes = numel * 4
    else:
        inp = rng.random(numel, dtype=np.float32)
        out = inp
        nbytes = 0 if op == "barrier" else numel * 4
    if use_torch:
        import torch

        return _Buffers(inp, out, torch.from_numpy(inp), torch.from_numpy(out), nbytes)
    return _Buffers(inp, out, inp, out, nbytes)


class _Library(Protocol):
    """The little each library must offer the timing loop."""

    label: str

    def run(self, op: str, b: _Buffers) -> None: ...

    def barrier(self) -> None: ...

    def max_over_ranks(self, value: float) -> float: ...


class _TorchLike:
    """rankwise and torch.distributed share the API; only the module differs."""

    def __init__(self, label: str, module: Any) -> None:
        self.label = label
        self._d = module

    def run(self, op: str, b: _Buffers) -> None:
        d = self._d
        if op == "all_reduce":
            d.all_reduce(b.inp)
        elif op == "broadcast":
            d.broadcast(b.inp, src=0)
        elif op == "all_gather":
            d.all_gather_into_tensor(b.out, b.inp)
        elif op == "reduce_scatter":
            d.reduce_scatter_tensor(b.out, b.inp)
        elif op == "all_to_all":
            d.all_to_all_single(b.out, b.inp)
        elif op == "barrier":
            d.barrier()
        else:
            raise ValueError(f"unknown op {op!r}")

    def barrier(self) -> None:
        self._d.barrier()

    def max_over_ranks(self, value: float) -> float:
        if self.label == "gloo":
            import torch

            t = torch.tensor([value], dtype=torch.float64)
            self._d.all_reduce(t, op=self._d.ReduceOp.MAX)
            return float(t[0])
        a = np.array([value], dtype=np.float64)
        self._d.all_reduce(a, op=self._d.ReduceOp.MAX)
        return float(a[0])


class _Mpi:
    """mpi4py's buffer interface on the numpy views of the same buffers."""

    label = "mpi"

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm, self._mpi = comm, mpi

    def run(self, op: str, b: _Buffers) -> None:
        c = self._comm
        if op == "all_reduce":
            c.Allreduce(self._mpi.IN_PLACE, b.np_inp)
        elif op == "broadcast":
            c.Bcast(b.np_inp, root=0)
        elif op == "all_gather":
            c.Allgather(b.np_inp, b.np_out)
        elif op == "reduce_scatter":
            c.Reduce_scatter_block(b.np_inp, b.np_out)
        elif op == "all_to_all":
            c.Alltoall(b.np_inp, b.np_out)
        elif op == "barrier":
            c.Barrier()
        else:
            raise ValueError(f"unknown op {op!r}")

    def barrier(self) -> None:
        self._comm.Barrier()

    def max_over_ranks(self, value: float) -> float:
        return float(self._comm.allreduce(value, op=self._mpi.MAX))


@dataclass(frozen=True)
class _Run:
    """How a cell's batches run: the pattern, this rank, and the side call of
    ``interleaved``/``stopflag`` (a gloo all_reduce on a gloo group of its own)."""

    pattern: Pattern
    rank: int
    side: Callable[[], None] | None = None


def _time(lib: _Library, op: str, b: _Buffers, iters: int, how: _Run) -> tuple[float, float]:
    """Mean and median seconds per call over ``iters`` calls under the pattern, each the
    slowest rank's."""
    lib.barrier()
    t = timed_batch(how.pattern, how.rank, iters, lambda: lib.run(op, b), how.side)
    return lib.max_over_ranks(t.mean), lib.max_over_ranks(t.median)


def _calibrate(lib: _Library, op: str, b: _Buffers, round_time: float, how: _Run) -> int:
    """Warm up, then find the iteration count that fills ``round_time``.

    Doubling until a timed batch lasts a tenth of the target keeps small messages from
    being judged by one noisy call; every decision uses the max over ranks, so all ranks
    take the same branches and agree on the count without another message.  The batch's
    wall time counts (skew compute and side calls included), so a round stays near
    ``round_time`` whatever the pattern.
    """
    for _ in range(2):
        lib.run(op, b)
    k = 1
    while True:
        t0 = time.perf_counter()
        _time(lib, op, b, k, how)
        per_iter = lib.max_over_ranks((time.perf_counter() - t0) / k)
        if per_iter * k >= round_time / 10 or k >= _MAX_ITERS:
            break
        k *= 2
    return int(max(1, min(_MAX_ITERS, round_time / max(per_iter, 1e-9))))


def _side_call(op: str, b: _Buffers, group: Any,
               pattern: Pattern) -> Callable[[], None] | None:
    """The call after each timed one, on ``group`` (None: no side call): ``interleaved``'s
    gloo all_reduce of the cell's size, or ``stopflag``'s one-element MAX."""
    if group is None:
        return None
    import torch
    import torch.distributed as tdist

    if pattern.name == "stopflag":
        flag = torch.zeros(1, dtype=torch.float32)
        return lambda: tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
    buf = torch.zeros(max(1, b.nbytes // 4), dtype=torch.float32)
    return lambda: tdist.all_reduce(buf, group=group)


def _cell(libs: list[_Library], op: str, size: int, n: int, rank: int, cfg: WorkerConfig,
          use_torch: bool, side_group: Any = None) -> dict[str, Any]:
    b = _buffers(op, size, n, rank, use_torch)
    how = _Run(cfg.pattern, rank, _side_call(op, b, side_group, cfg.pattern))
    iters = {lib.label: cfg.iters or _calibrate(lib, op, b, cfg.round_time, how)
             for lib in libs}
    samples: dict[str, list[float]] = {lib.label: [] for lib in libs}
    medians: dict[str, list[float]] = {lib.label: [] for lib in libs}
    cpu = {lib.label: _CpuTime() for lib in libs}
    for i in range(cfg.rounds):
        k = i % len(libs)  # rotate who goes first: no library always runs right after another
        for lib in libs[k:] + libs[:k]:
            with cpu[lib.label]:
                mean, median = _time(lib, op, b, iters[lib.label], how)
            samples[lib.label].append(mean)
            medians[lib.label].append(median)
    kernel = {lib.label: lib.max_over_ranks(cpu[lib.label].kernel_share()) for lib in libs}
    return {"op": op, "bytes": b.nbytes, "iters": iters, "seconds": samples,
            "median_seconds": medians, "kernel": kernel}


class _CpuTime:
    """This process's CPU time (every thread: the library's helper threads too), split into
    user and kernel, summed over the rounds it wraps.

    Why: the shared-memory engine's point is to take the kernel's copies out of the data
    path (loopback TCP spent 72-77% of the CPU in the kernel); the kernel's share of the
    CPU a library burns says whether bytes still go through it.
    """

    def __init__(self) -> None:
        self.user = 0.0
        self.kernel = 0.0
        self._start = os.times()

    def __enter__(self) -> None:
        self._start = os.times()

    def __exit__(self, *exc: object) -> None:
        end = os.times()
        self.user += end.user - self._start.user
        self.kernel += end.system - self._start.system

    def kernel_share(self) -> float:
        """Kernel time over all CPU time (0 when the clock did not tick: os.times counts
        in scheduler ticks, 10 ms on most kernels)."""
        total = self.user + self.kernel
        return self.kernel / total if total > 0 else 0.0


# --- joining the job ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _start_mpi() -> tuple[_Mpi, Any, str]:
    from mpi4py import MPI

    version = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    return _Mpi(MPI.COMM_WORLD, MPI), MPI.COMM_WORLD, version


def _master(rank: int, comm: Any) -> tuple[str, int]:
    """Where rank 0 is.  MASTER_ADDR/MASTER_PORT when set (the launcher sets them); under
    mpirun without them, ask MPI: loopback when every rank is on rank 0's host."""
    addr = os.environ.get("MASTER_ADDR") or None
    raw_port = os.environ.get("MASTER_PORT") or None
    port = int(raw_port) if raw_port else None
    if comm is not None and (addr is None or port is None):
        hosts = comm.allgather(socket.gethostname())
        if addr is None:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        if port is None:
            port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    if addr is None or port is None:
        raise RuntimeError("rankwise bench: this job has no MASTER_ADDR/MASTER_PORT; under "
                           "mpirun either keep MPI on (mpi4py installed) or pass them with "
                           "`mpirun -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 ...`")
    return addr, port


def _start_rankwise(engine: str, base: Any, addr: str, rank: int, n: int) -> _TorchLike:
    import rankwise
    from rankwise.store import TCPStore

    # A fresh store per pass, served by rank 0: a second init_process_group in the same
    # process must not meet the first one's rank claims. (A PrefixStore over ``base`` would
    # do, but init wraps it in a PrefixStore of its own and nested PrefixStores drop the
    # outer prefix today.)
    timeout = timedelta(seconds=_INIT_TIMEOUT_S)
    if rank == 0:
        store = TCPStore(addr, 0, is_master=True, timeout=timeout)
        base.set(f"bench/{engine}/port", str(store.port))
    else:
        port = int(base.get(f"bench/{engine}/port").decode())
        store = TCPStore(addr, port, is_master=False, timeout=timeout)
    os.environ["RANKWISE_ENGINE"] = engine  # read at init time by the engine selection
    rankwise.init_process_group("tcp", store=store, rank=rank, world_size=n, timeout=timeout)
    from rankwise.api.world import current

    # a column is only worth its label if the group really runs on that engine
    running = getattr(getattr(current().default_group, "engine", None), "name", "tcp")
    if running != engine:
        raise RuntimeError(f"rankwise bench: asked for engine {engine!r} with RANKWISE_ENGINE "
                           f"but the group runs on {running!r}")
    return _TorchLike(f"rankwise-{engine}", rankwise)


def _start_gloo(base: Any, addr: str, rank: int, n: int) -> _TorchLike:
    import torch.distributed as tdist

    # torch deprecates the *_tensor names it still documents; not news for a benchmark
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if rank == 0:
        base.set("bench/gloo-port", str(_free_port()))
    port = int(base.get("bench/gloo-port").decode())
    # An explicit store: under ``rankwise run`` (TORCHELASTIC_USE_AGENT_STORE=True) torch's
    # tcp:// rendezvous would expect the launcher to serve this port, and wait forever.
    timeout = timedelta(seconds=_INIT_TIMEOUT_S)
    store = tdist.TCPStore(addr, port, n, is_master=rank == 0,  # type: ignore[attr-defined]
                           timeout=timeout)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    return _TorchLike("gloo", tdist)


def _side_group() -> Any:
    """A gloo group of every rank, apart from the one gloo is timed on, for
    ``interleaved``'s and ``stopflag``'s side calls (needs gloo up: ``run.py`` checks before any process)."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo")


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"rankwise bench: {text}", file=sys.stderr, flush=True)


def run_worker(cfg: WorkerConfig) -> dict[str, Any] | None:
    """Measure every (engine, op, size) cell; rank 0 returns the raw numbers, others None.

    The rank and world size come from the environment (``rankwise run`` or ``mpirun``).
    """
    from rankwise.launch.env import require_env
    from rankwise.store import TCPStore

    env = require_env(os.environ)
    rank, n = env.rank, env.world_size
    mpi, comm, mpi_version = _start_mpi() if cfg.mpi else (None, None, "")
    addr, port = _master(rank, comm)
    launched = settings.flag("RANKWISE_AGENT_STORE")  # the launcher hosts the store
    base = TCPStore(addr, port, is_master=rank == 0 and not launched,
                    timeout=timedelta(seconds=_INIT_TIMEOUT_S))
    use_torch = cfg.gloo or _has_torch()
    gloo = _start_gloo(base, addr, rank, n) if cfg.gloo else None
    side_group = _side_group() if cfg.pattern.has_side else None
    versions = _versions(mpi_version if cfg.mpi else None, cfg.gloo)
    passes = []
    try:
        for engine in cfg.engines:
            rw = _start_rankwise(engine, base, addr, rank, n)
            libs: list[_Library] = [rw] + [x for x in (gloo, mpi) if x is not None]
            cells = []
            for op in cfg.ops:
                t0 = time.monotonic()
                for size in cfg.sizes if op != "barrier" else (0,):
                    cells.append(_cell(libs, op, size, n, rank, cfg, use_torch, side_group))
                _say(rank, f"n={n} engine {engine}: {op} done in "
                          f"{time.monotonic() - t0:.1f}s")
            import rankwise

            rankwise.destroy_process_group()
            passes.append({"engine": engine, "cells": cells})
    finally:
        if gloo is not None:
            import torch.distributed as tdist

            tdist.destroy_process_group()
        _leave(base, rank, n)
    if rank != 0:
        return None
    return {"world_size": n, "host": socket.gethostname(), "cpus": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "rounds": cfg.rounds, "round_time": cfg.round_time, "iters": cfg.iters,
            "pattern": cfg.pattern.name, "skew_us": cfg.pattern.skew_us,
            "versions": versions, "passes": passes}


def _leave(base: Any, rank: int, n: int) -> None:
    """Close the store, rank 0 last: under mpirun rank 0 serves it, and a rank still
    talking to it must not meet a closed port instead of its answer."""
    try:
        base.add("bench/left", 1)
        deadline = time.monotonic() + 10.0
        while rank == 0 and int(base.add("bench/left", 0)) < n and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        base.close()


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _versions(mpi: str | None, gloo: bool) -> dict[str, str]:
    import rankwise

    out = {"rankwise": str(getattr(rankwise, "__version__", "?"))}
    if gloo:
        import torch

        out["gloo"] = f"torch {torch.__version__}"
    if mpi is not None:
        out["mpi"] = mpi
    return out
