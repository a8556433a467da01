"""The reporting half of ``rankwise bench``: raw numbers in, table and plot out.

Kept apart from the measuring so that a saved ``--json`` file can be re-rendered
(``rankwise bench --from-json raw.json --plot out.png``) and the formatting is tested
without starting a process.

Conventions, chosen once here:

* latency: the median over rounds of each round's per-call time (the slowest rank's);
* bus bandwidth: nccl-tests' busbw, size / latency * factor (see ``bus_factor``);
* ratio ``X/Y``: rankwise time / other library's time, so **< 1 means rankwise is
  faster**; the range after it is the lowest and highest ratio of single paired rounds
  (same round, same pass), i.e. how far one round's verdict strays: the machine's noise.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .worker import OPS, bus_factor

__all__ = ["PLOT_HINT", "format_tables", "human_size", "plot", "summarize"]

PLOT_HINT = "--plot needs matplotlib: pip install 'rankwise[plot]'"
_REFERENCES = ("gloo", "mpi")


def human_size(nbytes: int) -> str:
    """4 -> '4 B', 1024 -> '1 KiB', 16 MiB -> '16 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            # all_gather of 64 KiB on 3 ranks moves 3 equal pieces: 65532 B, "~64 KiB"
            exact = nbytes % scale == 0
            return f"{'' if exact else '~'}{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def _libraries(run: dict[str, Any]) -> list[str]:
    """Column order: each rankwise engine (pass order), then gloo, then MPI."""
    seen: list[str] = []
    for p in run["passes"]:
        for cell in p["cells"]:
            for label in cell["seconds"]:
                if label not in seen:
                    seen.append(label)
    ours = [x for x in seen if x.startswith("rankwise-")]
    return ours + [x for x in _REFERENCES if x in seen]


def summarize(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (op, size) of one world size.

    ``latency[lib]``: median seconds; gloo and MPI pool their rounds from every pass.
    ``ratio[(engine_label, ref)]``: (median ratio, lowest, highest) from that pass only.
    ``kernel[lib]``: the kernel's share of the CPU the busiest rank spent in that library's
    rounds (gloo and MPI: their last pass).
    """
    n = int(run["world_size"])
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for p in run["passes"]:
        for cell in p["cells"]:
            key = (cell["op"], int(cell["bytes"]))
            row = rows.setdefault(key, {"op": key[0], "bytes": key[1], "samples": {},
                                        "ratio": {}, "kernel": {}, "medians": {},
                                        "median_ratio": {}})
            row["kernel"].update(cell.get("kernel", {}))  # runs saved before it had none
            secs: dict[str, list[float]] = cell["seconds"]
            for label, values in secs.items():
                row["samples"].setdefault(label, []).extend(values)
            meds: dict[str, list[float]] = cell.get("median_seconds", {})  # runs before it
            for label, values in meds.items():
                row["medians"].setdefault(label, []).extend(values)
            ours = [x for x in secs if x.startswith("rankwise-")]
            for mine in ours:
                for ref in _REFERENCES:
                    if ref in secs:
                        paired = [a / b for a, b in zip(secs[mine], secs[ref]) if b > 0]
                        med = statistics.median(secs[mine]) / statistics.median(secs[ref])
                        row["ratio"][(mine, ref)] = (med, min(paired), max(paired))
                    if ref in meds and mine in meds:
                        row["median_ratio"][(mine, ref)] = _paired(meds[mine], meds[ref])
    out = []
    for key in sorted(rows, key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 99, k[1])):
        row = rows[key]
        row["latency"] = {lab: statistics.median(v) for lab, v in row["samples"].items()}
        row["median"] = {lab: statistics.median(v) for lab, v in row["medians"].items()}
        factor = bus_factor(row["op"], n)
        row["busbw"] = {lab: (row["bytes"] / s * factor / 1e9 if s > 0 and factor else None)
                        for lab, s in row["latency"].items()}
        out.append(row)
    return out


def _paired(mine: list[float], ref: list[float]) -> tuple[float, float, float]:
    """(ratio of the medians over rounds, lowest, highest single-round ratio)."""
    paired = [a / b for a, b in zip(mine, ref) if b > 0]
    med = statistics.median(mine) / statistics.median(ref)
    return (med, min(paired, default=med), max(paired, default=med))


def _short(label: str) -> str:
    return label.removeprefix("rankwise-")


def format_tables(runs: list[dict[str, Any]]) -> list[str]:
    """The printed report, one block per world size; returns the lines."""
    lines: list[str] = []
    for run in runs:
        libs = _libraries(run)
        rows = summarize(run)
        pairs = [(m, r) for r in _REFERENCES if r in libs for m in libs
                 if m.startswith("rankwise-")]
        versions = ", ".join(f"{k} {v}" if k == "rankwise" else v
                             for k, v in run.get("versions", {}).items())
        lines.append(f"n={run['world_size']} ranks on {run.get('host', '?')} "
                     f"({run.get('cpus', '?')} CPUs), {run['rounds']} alternating rounds; "
                     f"{versions}")
        allowed, cpus = run.get("cpus_allowed"), run.get("cpus")
        if allowed and cpus and allowed < cpus:
            # mpirun binds each rank to one core by default: every library's helper threads
            # then share it with the rank's main thread, and latencies say more about that
            lines.append(f"note: rank 0 was pinned to {allowed} of {cpus} CPUs (mpirun binds "
                         "by default; pass --bind-to none to compare the libraries unpinned)")
        pattern = run.get("pattern", "lockstep")
        if pattern != "lockstep":
            what = {"skewed": f"a random busy compute of 0..{run.get('skew_us', 0):g} us "
                              "before each call",
                    "stopflag": "each call followed by a one-element gloo all_reduce (MAX) "
                                "on another group, a loop's stop flag",
                    }.get(pattern, "each call followed by a gloo all_reduce of the same size "
                                   "on another group")
            lines.append(f"pattern {pattern}: {what}; only the call is timed. 'us' and ratio "
                         "use each round's mean per call; 'p50' columns its median per call")
        lines.append("latency: median us per call; busbw: GB/s (nccl-tests); sys%: the "
                     "kernel's share of the CPU spent (busiest rank); ratio: rankwise "
                     "time / other's, <1 = rankwise faster (lowest-highest single round)")
        if len({m for m, _ in pairs}) > 1:  # several passes: gloo/MPI columns are pooled
            lines.append("gloo/MPI columns pool every pass; each ratio pairs an engine with "
                         "the gloo/MPI rounds of its own pass, so it can differ from them")
        head = f"{'op':<14} {'size':>9} "
        head += " ".join(f"{_short(x) + ' us':>10}" for x in libs) + "  "
        head += " ".join(f"{_short(x) + ' GB/s':>10}" for x in libs) + "  "
        head += " ".join(f"{_short(x) + ' sys%':>10}" for x in libs) + "  "
        head += " ".join(f"{_short(m) + '/' + r:>16}" for m, r in pairs)
        p50 = pattern != "lockstep"
        if p50:
            head += "  " + " ".join(f"{_short(x) + ' p50':>10}" for x in libs)
            head += "  " + " ".join(f"{_short(m) + '/' + r + ' p50':>16}" for m, r in pairs)
        lines.append(head.rstrip())
        for row in rows:
            line = f"{row['op']:<14} {human_size(row['bytes']) if row['bytes'] else '-':>9} "
            line += " ".join(_num(row["latency"].get(x), 1e6, 1) for x in libs) + "  "
            line += " ".join(_num(row["busbw"].get(x), 1.0, 3) for x in libs) + "  "
            line += " ".join(_num(row["kernel"].get(x), 100.0, 0) for x in libs) + "  "
            line += " ".join(_ratio(row["ratio"].get(p)) for p in pairs)
            if p50:
                line += "  " + " ".join(_num(row["median"].get(x), 1e6, 1) for x in libs)
                line += "  " + " ".join(_ratio(row["median_ratio"].get(p)) for p in pairs)
            lines.append(line.rstrip())
        lines.append("")
    return lines


def _num(value: float | None, scale: float, digits: int) -> str:
    return f"{'-':>10}" if value is None else f"{value * scale:>10.{digits}f}"


def _ratio(r: tuple[float, float, float] | None) -> str:
    if r is None:
        return f"{'-':>16}"
    med, lo, hi = (_ratio_text(x) for x in r)
    return f"{f'{med} ({lo}-{hi})':>16}"


def _ratio_text(x: float) -> str:
    """Two significant digits below 1 (0.15, 0.0052: a ratio far below gloo's must not
    print as 0.00), two decimals up to 10, whole numbers above."""
    if x >= 10:
        return f"{x:.0f}"
    if x <= 0:
        return "0"
    if x < 1e-4:
        return f"{x:.1e}"
    return f"{x:.{max(2, 1 - math.floor(math.log10(x)))}f}"


_COLORS = {"gloo": "tab:orange", "mpi": "tab:green"}
_OURS = ("tab:blue", "tab:purple", "tab:cyan", "tab:red")


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Latency (log-log) and busbw against size: a row of two panels per op, one line per
    library and engine, line style per world size.  Barrier (no size axis) is left out.

    matplotlib is imported here only, so the bench runs without it; callers check for it
    before any process starts (``PLOT_HINT``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(c["op"] == op for r in runs for p in r["passes"]
                                   for c in p["cells"]) and op != "barrier"]
    if not ops:
        raise ValueError("nothing to plot: barrier has no size axis; add a sized op")
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.6 * len(ops)), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for i, op in enumerate(ops):
        lat_ax, bw_ax = axes[i][0], axes[i][1]
        for j, run in enumerate(runs):
            rows = [r for r in summarize(run) if r["op"] == op]
            for k, lib in enumerate(_libraries(run)):
                pts = [(r["bytes"], r["latency"][lib], r["busbw"][lib]) for r in rows
                       if lib in r["latency"]]
                if not pts:
                    continue
                name = ("rankwise " + _short(lib) if lib.startswith("rankwise-")
                        else "torch gloo" if lib == "gloo" else "MPI")
                color = _COLORS.get(lib, _OURS[k % len(_OURS)])
                kw = {"color": color, "linestyle": styles[j % len(styles)], "marker": ".",
                      "label": f"{name}, n={run['world_size']}"}
                lat_ax.plot([p[0] for p in pts], [p[1] * 1e6 for p in pts], **kw)
                bw_ax.plot([p[0] for p in pts], [p[2] or 0.0 for p in pts], **kw)
        lat_ax.set(yscale="log", xlabel="size", ylabel="latency (us)",
                   title=f"{op}: latency (lower is better)")
        bw_ax.set(xlabel="size", ylabel="bus bandwidth (GB/s)",
                  title=f"{op}: bus bandwidth (higher is better)")
        sizes = sorted({r["bytes"] for run in runs for r in summarize(run) if r["op"] == op})
        ticks = [t for t in (4 * 16**i for i in range(8)) if sizes[0] <= t <= sizes[-1]]
        for ax in (lat_ax, bw_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [human_size(t) for t in ticks])
            ax.grid(True, which="major", alpha=0.3)
        bw_ax.legend(fontsize=8)
    host = runs[0].get("host", "?")
    fig.suptitle(f"rankwise bench on {host} ({runs[0].get('cpus', '?')} CPUs)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
