"""``rankwise bench`` on two trees, alternated in one session, their ratios side by side.

    python benchmarks/bench_ab.py --old /tmp/wt-old --new . --reps 3 -- \\
        -n 2,4 --sizes 4,4K,1M --engines shm,tcp [--pattern skewed|interleaved|stopflag]

Why: on a shared machine a latency means nothing between two runs; rankwise's time over
gloo's, measured in the same processes and rounds (``rankwise bench``'s ratio), does.
Each rep runs the bench once per tree, the order swapped every rep, each tree's own
rankwise and its own ``rankwise bench`` (its ``src`` first on ``PYTHONPATH``). Per cell
(ranks, engine, op, size) the table gives each tree's rankwise/gloo of single rounds
(paired in the round), pooled over the reps: median and quartiles; then new/old of the
medians: below 1 the new tree is faster; then each rep's median, old | new. ``worse``
marks a cell whose new quartiles lie wholly above the old ones and whose every new rep
is above every old one. The machine's own noise comes first: two identical trees on
the loaded 2-core machine differed by 0.25-4.6x in single cells with 1-2 reps; judge a
change by many cells moving together, 3 reps or more, on a quiet machine.

A pattern the old tree lacks (``stopflag`` before it existed): copy the new tree's
``src/rankwise/bench`` into a throwaway worktree of the old commit first; the bench
drives rankwise through its public API only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: (ranks, engine label, op, bytes): one cell of the bench
Cell = tuple[int, str, str, int]


def run_bench(tree: Path, args: list[str], timeout: float) -> list[dict[str, Any]]:
    """One ``rankwise bench`` of ``tree``'s own rankwise; its saved runs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree / "src"), env.get("PYTHONPATH", ""))
                                        if p)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        raw = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-m", "rankwise", "bench", *args, "--no-mpi", "--json", raw]
        done = subprocess.run(cmd, cwd=tree, env=env, timeout=timeout, check=False,
                              capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(raw):
            raise SystemExit(f"{tree}: rankwise bench failed ({done.returncode}):\n"
                             f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        with open(raw, encoding="utf-8") as f:
            runs: list[dict[str, Any]] = json.load(f)["runs"]
    return runs


def ratios(runs: list[dict[str, Any]]) -> dict[Cell, list[float]]:
    """rankwise/gloo of each round (the two timed in the same round of the same pass),
    per cell of one bench's saved runs."""
    out: dict[Cell, list[float]] = {}
    for run in runs:
        for p in run["passes"]:
            for cell in p["cells"]:
                secs: dict[str, list[float]] = cell["seconds"]
                for mine in (x for x in secs if x.startswith("rankwise-") and "gloo" in secs):
                    key = (int(run["world_size"]), mine, cell["op"], int(cell["bytes"]))
                    out.setdefault(key, []).extend(
                        a / b for a, b in zip(secs[mine], secs["gloo"], strict=True) if b > 0)
    return out


def _quartiles(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3


def _fmt(q: list[float]) -> str:
    return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})"


def _reps(reps: list[dict[Cell, list[float]]], cell: Cell) -> list[float]:
    """Each rep's median ratio of ``cell`` (the reps that have it)."""
    return [statistics.median(r[cell]) for r in reps if r.get(cell)]


def table(old: list[dict[Cell, list[float]]], new: list[dict[Cell, list[float]]]) -> list[str]:
    """Each cell's single-round ratios pooled over the reps, old and new: median
    (quartiles), each rep's median, and new/old of the pooled medians."""
    lines = [(f"{'ranks':>5} {'engine':<14} {'op':<11} {'bytes':>8}  {'old rw/gloo':>18}  "
             f"{'new rw/gloo':>18}  {'new/old':>7}  reps old | new")]
    for cell in sorted(set().union(*old, *new)):
        ra, rb = _reps(old, cell), _reps(new, cell)
        if not ra or not rb:
            continue
        a = _quartiles([x for r in old for x in r.get(cell, [])])
        b = _quartiles([x for r in new for x in r.get(cell, [])])
        change = b[1] / a[1] if a[1] else float("inf")
        # rounds of one rep share its machine state: the reps must part too
        worse = "  worse" if b[0] > a[2] and min(rb) > max(ra) and len(ra) > 1 else ""
        n, engine, op, size = cell
        each = " ".join(f"{x:.2f}" for x in ra) + " | " + " ".join(f"{x:.2f}" for x in rb)
        lines.append(f"{n:>5} {engine:<14} {op:<11} {size:>8}  {_fmt(a):>18}  {_fmt(b):>18}  "
                     f"{change:>7.2f}  {each}{worse}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--reps", type=int, default=3, help="bench runs per tree, alternated")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench run")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write every rep's saved runs, by tree")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then rankwise bench's options")
    ns = parser.parse_args(argv)
    args = ns.bench[1:] if ns.bench[:1] == ["--"] else ns.bench
    trees = {"old": ns.old.resolve(), "new": ns.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "src" / "rankwise").is_dir():
            parser.error(f"--{name} {tree}: no src/rankwise there")
    if ns.reps < 1:
        parser.error("--reps must be at least 1")
    got: dict[str, list[list[dict[str, Any]]]] = {"old": [], "new": []}
    for rep in range(ns.reps):
        for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            print(f"rep {rep + 1}: {name} ({trees[name]})", file=sys.stderr, flush=True)
            got[name].append(run_bench(trees[name], args, ns.timeout))
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"bench": args, "trees": {k: str(v) for k, v in trees.items()}, **got}, f)
    print(f"rankwise bench {' '.join(args)}: {ns.reps} reps per tree, alternated")
    print("\n".join(table([ratios(r) for r in got["old"]], [ratios(r) for r in got["new"]])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
