"""rankwise vs torch.distributed (gloo), side by side in one run, same inputs.

Each rank process initializes BOTH libraries, and for every (op, size) row times gloo
and rankwise on the same tensor in alternating rounds (median reported), so machine
noise hits both alike. Printed
per row: latency (max over ranks of the mean per-op time), bus bandwidth (nccl-tests
definitions), and the rankwise/gloo ratio (>1 means rankwise is faster for bandwidth,
and the latency ratio is rankwise/gloo time, <1 means rankwise is faster), with the
lowest and highest bandwidth ratio of single rounds: the machine's noise, in the row.

    python benchmarks/collectives.py                 # 2 and 4 ranks, all_reduce, 4 B..64 MiB
    python benchmarks/collectives.py --ranks 2 --ops all_reduce,broadcast --max-size 16M
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _bus_factor(op: str, n: int) -> float:
    """nccl-tests: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def _run_op(lib: Any, op: str, t: Any, scratch: Any, n: int) -> None:
    if op == "all_reduce":
        lib.all_reduce(t)
    elif op == "broadcast":
        lib.broadcast(t, src=0)
    elif op == "all_gather":
        lib.all_gather_into_tensor(scratch, t)
    elif op == "reduce_scatter":
        lib.reduce_scatter_tensor(t, scratch)
    elif op == "barrier":
        lib.barrier()
    else:
        raise ValueError(op)


def _max_over_ranks(lib: Any, seconds: float) -> float:
    import torch

    t = torch.tensor([seconds], dtype=torch.float64)
    lib.all_reduce(t, op=lib.ReduceOp.MAX)
    return float(t[0])


def _calibrate(lib: Any, op: str, t: Any, scratch: Any, n: int, budget: float) -> int:
    """Warm up, then pick an iteration count (agreed by all ranks) that fills ``budget``."""
    for _ in range(2):
        _run_op(lib, op, t, scratch, n)
    lib.barrier()
    t0 = time.perf_counter()
    _run_op(lib, op, t, scratch, n)
    one = _max_over_ranks(lib, time.perf_counter() - t0)
    return int(max(3, min(2000, budget / max(one, 1e-6))))


def _time(lib: Any, op: str, t: Any, scratch: Any, n: int, iters: int) -> float:
    """Mean seconds per call over ``iters`` calls, the slowest rank's."""
    lib.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _run_op(lib, op, t, scratch, n)
    return _max_over_ranks(lib, (time.perf_counter() - t0) / iters)


def _compare(libs: dict[str, Any], op: str, t: Any, scratch: Any, n: int, budget: float,
             rounds: int) -> dict[str, list[float]]:
    """Per-op seconds of each library in ``rounds`` alternating rounds (gloo first, then
    rankwise first, ...): a slow spell of the shared machine then lands on both
    libraries, not on one, and round i of one library pairs with round i of the other."""
    iters = {name: _calibrate(lib, op, t, scratch, n, budget / rounds)
             for name, lib in libs.items()}
    samples: dict[str, list[float]] = {name: [] for name in libs}
    order = list(libs)
    for i in range(rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            samples[name].append(_time(libs[name], op, t, scratch, n, iters[name]))
    return samples


def _worker(rank: int, n: int, port_rw: int, port_tg: int, ops: list[str], sizes: list[int],
            budget: float, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as tdist

    import rankwise

    # torch 2.13 deprecates the *_tensor names it still documents; not our news here
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    rankwise.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port_rw}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=300))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_tg}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=300))
    rows = []
    for op in ops:
        for size in sizes if op != "barrier" else [0]:
            numel = max(1, size // 4)
            if op in ("all_gather", "reduce_scatter"):
                numel = max(1, numel // n)  # per-rank piece; the row's size is the total
            torch.manual_seed(rank)
            t = torch.rand(numel, dtype=torch.float32)
            scratch = None
            if op == "all_gather":
                scratch = torch.empty(numel * n, dtype=torch.float32)
            elif op == "reduce_scatter":
                scratch = torch.rand(numel * n, dtype=torch.float32)
            times = _compare({"gloo": tdist, "rankwise": rankwise}, op, t, scratch, n,
                             budget, rounds)
            # nccl-tests: all_gather/reduce_scatter sizes are the whole (gathered) buffer
            total = numel * 4 * (n if op in ("all_gather", "reduce_scatter") else 1)
            rows.append((op, total if op != "barrier" else 0, times["gloo"], times["rankwise"]))
    if rank == 0:
        out.put(rows)
    rankwise.destroy_process_group()
    tdist.destroy_process_group()


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _collect(procs: list[Any], q: Any, limit: float) -> Any:
    """The rows rank 0 puts on ``q``; fails at once when a worker dies instead."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"benchmark worker {dead[0].name} exited with "
                                   f"{dead[0].exitcode} (its traceback is above)")
    raise TimeoutError(f"no benchmark result within {limit:.0f}s")


def run(ranks: list[int], ops: list[str], sizes: list[int], budget: float,
        rounds: int = 3) -> list[str]:
    ctx = mp.get_context("spawn")
    lines = []
    header = (f"{'ranks':>5} {'op':<15} {'size':>9} {'gloo lat':>10} {'rw lat':>10} "
              f"{'gloo busbw':>11} {'rw busbw':>10} {'rw/gloo lat':>11} {'rw/gloo bw':>10} "
              f"{'bw ratio range':>14}")
    print(header, flush=True)
    lines.append(header)
    for n in ranks:
        q = ctx.Queue()
        port_rw, port_tg = _free_port(), _free_port()
        procs = [ctx.Process(target=_worker, name=f"rank{r}",
                             args=(r, n, port_rw, port_tg, ops, sizes, budget, rounds, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        try:
            rows = _collect(procs, q, 1800)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        for op, nbytes, gs, rs in rows:
            g, r = statistics.median(gs), statistics.median(rs)
            f = _bus_factor(op, n)
            gbw = nbytes / g * f / 1e9 if nbytes else 0.0
            rbw = nbytes / r * f / 1e9 if nbytes else 0.0
            # each round's own ratio: how far one round's verdict can stray from the median
            paired = sorted(gi / ri for gi, ri in zip(gs, rs))
            line = (f"{n:>5} {op:<15} {_human(nbytes):>9} {g * 1e6:>8.1f}us {r * 1e6:>8.1f}us "
                    f"{gbw:>9.3f}GB/s {rbw:>8.3f}GB/s {r / g:>11.2f} "
                    f"{(rbw / gbw if gbw else float('nan')):>10.2f} "
                    f"{f'{paired[0]:.2f}-{paired[-1]:.2f}':>14}")
            print(line, flush=True)
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--ops", default="all_reduce", help=f"comma-separated: {','.join(OPS)}")
    ap.add_argument("--min-size", default="4")
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per cell")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating timing rounds per cell; the median is reported")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        ap.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    lo, hi = _parse_size(args.min_size), _parse_size(args.max_size)
    sizes = [s for s in SIZES if lo <= s <= hi]
    run([int(x) for x in args.ranks.split(",")], ops, sizes, args.budget, args.rounds)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
