"""How rankwise's control plane grows with the number of ranks, against torch's gloo.

Runs numpy-only rank scripts under ``rankwise run -n N`` and the same script under
``torchrun`` + gloo (numpy arrays wrapped as torch tensors), alternating the two at each
N, and prints per-N figures and rankwise/gloo ratios::

    python benchmarks/scale.py -n 2,4,8                  # a minute or two
    python benchmarks/scale.py -n 16,32,64 --repeat 2 --json scale.json
    python benchmarks/scale.py -n 256 --impl rankwise --iters 100
    python benchmarks/scale.py -n 4,16,64 --deadlock     # detection time (rankwise only)
    python benchmarks/scale.py -n 64 --compute           # waiters' CPU while rank 0 computes
    python benchmarks/scale.py -n 64 --compute --busy-rank 5   # ... while rank 5 does
    python benchmarks/scale.py --plot docs/scale.png --from scale.json

Per rank it records: init after imports, first 4-byte all_reduce, mean barrier and
4-byte all_reduce over ``--iters`` calls (timed between barriers, max over ranks), store
requests sent during init (rankwise), open fds, OS threads and RSS after the calls. With
``--deadlock`` every rank receives from its successor (a cycle of recvs): the figure is
the time from the last rank blocking to the last rank raising.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------ the rank script
def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(rest.split()[0])
    return out


def rank_main(impl: str, outdir: str, iters: int, mode: str) -> None:
    import numpy as np

    if impl == "gloo":
        import torch
        import torch.distributed as dist

        def tensor(a: Any) -> Any:
            return torch.from_numpy(a)

        def sent() -> int:
            return 0
    else:
        import rankwise as dist
        from rankwise.store.tcp import requests_sent as sent

        def tensor(a: Any) -> Any:
            return a
    t0, w0 = time.perf_counter(), time.time()
    before = sent()
    dist.init_process_group("gloo")
    t_init = time.perf_counter() - t0
    reqs = sent() - before
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: dict[str, Any] = {"rank": rank, "init_s": t_init, "store_requests": reqs,
                           "init_began": w0, "init_ended": time.time()}
    if mode == "deadlock":
        t = tensor(np.zeros(1, np.float32))
        rec["blocked"] = time.time()
        try:
            dist.recv(t, src=(rank + 1) % world)
        except Exception as exc:  # noqa: BLE001 - the figure is when it raises
            rec["raised"] = time.time()
            rec["error"] = type(exc).__name__
        _write(outdir, rank, rec)
        os._exit(0)
    if mode == "compute":  # one rank computes for 10 s; what do the waiters burn?
        busy = int(os.environ.get("SCALE_BUSY_RANK", "0")) % world
        dist.barrier()
        c0, t1 = time.process_time(), time.perf_counter()
        if rank == busy:
            while time.perf_counter() - t1 < 10.0:
                pass
        dist.barrier()
        rec["wait_cpu_s"] = time.process_time() - c0 if rank != busy else 0.0
        _write(outdir, rank, rec)
        dist.destroy_process_group()
        return
    small = tensor(np.ones(1, np.float32))
    t1 = time.perf_counter()
    dist.all_reduce(small)
    rec["first_s"] = time.perf_counter() - t1
    dist.barrier()
    t1 = time.perf_counter()
    for _ in range(iters):
        dist.barrier()
    rec["barrier_s"] = (time.perf_counter() - t1) / iters
    dist.barrier()
    t1 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(small)
    rec["allreduce4_s"] = (time.perf_counter() - t1) / iters
    dist.barrier()
    rec["fds"] = len(os.listdir("/proc/self/fd"))
    st = _proc_status()
    rec["threads"], rec["rss_mib"] = st["Threads"], st["VmRSS"] / 1024
    _write(outdir, rank, rec)
    dist.destroy_process_group()


def _write(outdir: str, rank: int, rec: dict[str, Any]) -> None:
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(rec, f)


# ------------------------------------------------------------------ the driver
def run_one(impl: str, n: int, iters: int, mode: str, timeout: float,
            busy: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rankwise-scale-") as outdir:
        worker = [HERE, "--worker", impl, outdir, str(iters), mode]
        if impl == "gloo":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={n}", *worker]
        else:
            cmd = [sys.executable, "-m", "rankwise", "run", "-n", str(n), *worker]
        env = dict(os.environ, RANKWISE_ENGINE="tcp", OMP_NUM_THREADS="1",
                   SCALE_BUSY_RANK=str(busy))
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, env=env, timeout=timeout,
                                  capture_output=True, text=True)
            rc: int | str = proc.returncode
            tail = (proc.stdout + proc.stderr)[-600:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        wall = time.perf_counter() - start
        recs = []
        for name in os.listdir(outdir):
            with open(os.path.join(outdir, name)) as f:
                recs.append(json.load(f))
    row: dict[str, Any] = {"impl": impl, "n": n, "mode": mode, "rc": rc, "wall_s": wall,
                           "ranks_reported": len(recs)}
    if mode == "compute":
        row["busy_rank"] = busy
    if len(recs) < n:
        row["tail"] = tail
    if not recs:
        return row
    if mode == "compute":
        row["waiters_cpu_s"] = sum(r.get("wait_cpu_s", 0.0) for r in recs)
        return row
    if mode == "deadlock":
        raised = [r["raised"] for r in recs if "raised" in r]
        row["detect_s"] = max(raised) - max(r["blocked"] for r in recs) if len(raised) == n \
            else None
        return row
    row["init_s"] = max(r["init_s"] for r in recs)
    # from the last rank calling init to the last rank done: the control plane's own
    # cost, without the spread of process start-up (which dominates init_s when the
    # ranks oversubscribe the cores)
    row["init_last_s"] = max(r["init_ended"] for r in recs) - max(r["init_began"] for r in recs)
    for key in ("first_s", "barrier_s", "allreduce4_s"):
        row[key] = max(r.get(key, 0.0) for r in recs)
    for key in ("store_requests", "fds", "threads", "rss_mib"):
        row[key] = statistics.mean(r.get(key, 0) for r in recs)
    row["store_requests_total"] = sum(r.get("store_requests", 0) for r in recs)
    return row


_COLS = ("init_s", "init_last_s", "first_s", "barrier_s", "allreduce4_s", "store_requests_total", "fds",
         "threads", "rss_mib")


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{'impl':9}{'N':>5}" + "".join(f"{c:>14}" for c in _COLS) + f"{'detect_s/waiters_cpu_s':>24}")
    for r in rows:
        cells = "".join(f"{r.get(c, float('nan')):>14.4g}" for c in _COLS)
        det = r.get("detect_s", r.get("waiters_cpu_s"))
        print(f"{r['impl']:9}{r['n']:>5}{cells}{'' if det is None else f'{det:>10.2f}'}"
              + ("" if r.get("rc") == 0 else f"  rc={r.get('rc')}"))
    ns = sorted({r["n"] for r in rows})
    print("\nrankwise/gloo (median ratio over repeats, [min..max]):")
    for n in ns:
        rw = [r for r in rows if r["n"] == n and r["impl"] == "rankwise" and "init_s" in r]
        gl = [r for r in rows if r["n"] == n and r["impl"] == "gloo" and "init_s" in r]
        if not rw or not gl:
            continue
        parts = []
        for c in ("init_s", "init_last_s", "first_s", "barrier_s", "allreduce4_s", "fds"):
            ratios = [a[c] / b[c] for a, b in zip(rw, gl) if b.get(c)]
            if ratios:
                parts.append(f"{c} {statistics.median(ratios):.2f}x "
                             f"[{min(ratios):.2f}..{max(ratios):.2f}]")
        print(f"  N={n}: " + ", ".join(parts))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(11, 6))
    axes = list(grid.flat)
    for ax, col, title in zip(axes, ("init_s", "init_last_s", "allreduce4_s", "barrier_s",
                                     "store_requests_total", "fds"),
                              ("init after imports, slowest rank (s)",
                               "init, last rank in to all done (s)", "4 B all_reduce (s)",
                               "barrier (s)", "store requests at init (job)",
                               "open fds per rank")):
        impls = sorted({r["impl"] for r in rows})
        for i, (impl, style) in enumerate(zip(impls, ("o-", "s--", "^:", "d-."))):
            by_n: dict[int, list[float]] = {}
            for r in rows:
                if r["impl"] == impl and r.get(col):
                    by_n.setdefault(r["n"], []).append(r[col])
            pts = sorted((n, statistics.median(v)) for n, v in by_n.items())  # over repeats
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl,
                        color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ranks")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _byte_compile() -> None:
    """Compile rankwise's modules as a wheel install does (torch's are): from an editable
    checkout under PYTHONDONTWRITEBYTECODE=1 every rank would compile most of them again,
    ~0.1 CPU-s a rank (64 ranks on 2 cores: init's last-in-to-done 0.32 s against 0.22 s).
    """
    import compileall

    import rankwise

    compileall.compile_dir(os.path.dirname(rankwise.__file__), quiet=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", default="2,4,8", help="comma-separated rank counts")
    p.add_argument("--impl", default="rankwise,gloo")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--deadlock", action="store_true")
    p.add_argument("--compute", action="store_true",
                   help="one rank computes 10 s: CPU the waiting ranks burn meanwhile")
    p.add_argument("--busy-rank", type=int, default=0,
                   help="with --compute: the rank that computes (0 is rankwise's deadlock "
                        "prober; another rank makes the prober wait and look)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="append rows to this JSON file")
    p.add_argument("--plot", help="write a PNG of the rows (with --from, or after the run)")
    p.add_argument("--from", dest="from_", help="read rows from this JSON file, run nothing")
    args = p.parse_args(argv)
    if args.from_:
        with open(args.from_) as f:
            rows = json.load(f)
    else:
        rows = []
        _byte_compile()
        impls = ["rankwise"] if args.deadlock else args.impl.split(",")
        mode = "deadlock" if args.deadlock else "compute" if args.compute else "calls"
        for n in (int(x) for x in args.n.split(",")):
            for rep in range(args.repeat):
                for impl in (impls if rep % 2 == 0 else impls[::-1]):
                    row = run_one(impl, n, args.iters, mode, args.timeout, args.busy_rank)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            old = []
            if os.path.exists(args.json):
                with open(args.json) as f:
                    old = json.load(f)
            with open(args.json, "w") as f:
                json.dump(old + rows, f, indent=1)
    report(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
