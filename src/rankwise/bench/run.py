"""``rankwise bench``: rankwise against torch gloo (and MPI) in the same processes.

    rankwise bench -n 4 --ops all_reduce --sizes 4..64M --plot bench.png --json raw.json
    mpirun --oversubscribe -n 4 rankwise bench --sizes 4..16M          # adds MPI columns

Three halves, one job each: this module parses and checks the command line (every mistake
is reported before a process starts), then either launches the job with ``rankwise run``'s
machinery and reads rank 0's numbers back, or -- inside ``mpirun`` or a launched worker --
measures (``_bench_worker``) and renders (``_bench_report``).  ``benchmarks/collectives.py``
is a thin wrapper over :func:`main`: one piece of code serves both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .. import settings
from .patterns import PATTERNS, Pattern
from .report import PLOT_HINT, format_tables, plot
from .worker import OPS, WorkerConfig

__all__ = ["add_bench_options", "available_engines", "main", "parse_sizes"]

FORMAT = "rankwise-bench/1"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_MAX_SIZE = 1 << 30
_SIZE = re.compile(r"\s*(\d+)\s*([a-zA-Z]*)\s*")


def _one_size(text: str, within: str = "") -> int:
    where = f" (in {within.strip()!r})" if within else ""
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r}{where} is not a size; write bytes with an optional binary "
            f"unit: 4, 1K, 16M, 1G")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 4 or value % 4 or value > _MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r}{where} = {value} bytes; sizes are whole float32 buffers: "
            f"multiples of 4 from 4 to 1G")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"4..64M"`` (powers of 4 from 4 B to 64 MiB), ``"4..1K:2"`` (powers of 2), or a comma
    list of sizes and ranges (``"4,1K,1M..16M"``); sorted, without repeats.

    Raises ``argparse.ArgumentTypeError`` with a message fit for the user."""
    sizes: set[int] = set()
    for part in text.split(","):
        if ".." not in part:
            sizes.add(_one_size(part))
            continue
        lo_text, _, rest = part.partition("..")
        hi_text, _, step_text = rest.partition(":")
        lo, hi = _one_size(lo_text, part), _one_size(hi_text, part)
        try:
            step = int(step_text) if step_text.strip() else 4
        except ValueError:
            step = 0
        if step < 2:
            raise argparse.ArgumentTypeError(
                f"in {part.strip()!r} the factor after ':' must be an integer >= 2")
        if lo > hi:
            raise argparse.ArgumentTypeError(
                f"range {part.strip()!r} runs backwards; write LOW..HIGH")
        size = lo
        while size <= hi:
            sizes.add(size)
            size *= step
    return tuple(sorted(sizes))


def _ranks(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"-n must be a number of ranks or a comma list like 2,4; got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"-n: a benchmark needs at least 2 ranks, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


#: engines a pass may name but none runs by default: ``tiers`` needs ranks on several hosts
MULTIHOST_ENGINES = ("tiers",)


def available_engines(every: bool = False) -> tuple[str, ...]:
    """The rankwise engines ``RANKWISE_ENGINE`` can name, ``auto`` left out: a pass measures
    one engine by name (each pass also checks that its group really runs on that engine).
    The multi-host ones only with ``every`` (what ``--engines`` accepts)."""
    try:
        from ..engines.select import ENGINES
    except ImportError:  # a rankwise from before the engine seam: TCP only
        return ("tcp",)
    return tuple(e for e in ENGINES
                 if e != "auto" and (every or e not in MULTIHOST_ENGINES))


def add_bench_options(p: argparse.ArgumentParser) -> None:
    """The options of ``rankwise bench`` (public so a wrapper can embed them in its parser)."""
    p.add_argument("-n", "--nproc", dest="nproc", type=_ranks, default=None,
                   help="ranks; a comma list runs one job per count (default 2; under mpirun: "
                        "mpirun's)")
    p.add_argument("--ops", type=_names, default=("all_reduce",),
                   help=f"comma list of {', '.join(OPS)}, or 'all' (default all_reduce)")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4..64M"),
                   help="LOW..HIGH in powers of 4 (LOW..HIGH:2 for powers of 2) or a comma "
                        "list, units K/M/G (default 4..64M)")
    p.add_argument("--engines", type=_names, default=None,
                   help="rankwise engines, one pass each (default: every available one)")
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating timing rounds per cell; medians are reported (default 5)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per round (default: adaptive, each round ~--round-time)")
    p.add_argument("--round-time", type=float, default=0.15,
                   help="seconds per library per round when adaptive (default 0.15)")
    p.add_argument("--pattern", choices=PATTERNS, default="lockstep",
                   help="what ranks do around each timed call: lockstep (back to back, the "
                        "default), skewed (a random busy compute of 0..--skew us before each "
                        "call), interleaved (each call followed by a gloo all_reduce of the "
                        "same size on another group), stopflag (each call followed by a "
                        "one-element gloo all_reduce MAX: a loop's stop flag); every library "
                        "runs the same pattern")
    p.add_argument("--skew", type=float, default=None, metavar="W",
                   help="skewed: the most compute (us) before a call (default 100)")
    p.add_argument("--no-gloo", dest="gloo", action="store_false",
                   help="leave torch gloo out")
    mpi = p.add_mutually_exclusive_group()
    mpi.add_argument("--mpi", dest="mpi", action="store_true", default=None,
                     help="include MPI (needs mpi4py and a start by mpirun; default: when both)")
    mpi.add_argument("--no-mpi", dest="mpi", action="store_false")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write latency and bus bandwidth against size (needs rankwise[plot])")
    p.add_argument("--json", metavar="FILE", default=None, help="write the raw numbers")
    p.add_argument("--from-json", metavar="FILE[,FILE...]", type=_names, default=None,
                   help="measure nothing: render the table (and --plot) of saved --json files, "
                        "e.g. one per mpirun -n")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw-out", default=None, help=argparse.SUPPRESS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rankwise bench",
        description="Time rankwise (each engine), torch gloo and MPI collectives in the same "
                    "processes, in alternating rounds; print latency, bus bandwidth and "
                    "ratios, optionally plot them.")
    add_bench_options(p)
    return p


def _under_mpirun() -> bool:
    return "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _note(text: str) -> None:
    print(f"rankwise bench: {text}", file=sys.stderr, flush=True)


def _check(p: argparse.ArgumentParser, ns: argparse.Namespace, worker: bool) -> WorkerConfig:
    """Every misuse found here, before any process starts; returns what ranks run."""
    ops = OPS if ns.ops == ("all",) else ns.ops
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        p.error(f"--ops: unknown {', '.join(unknown) or '(none)'}; choose from "
                f"{', '.join(OPS)} or all")
    engines = ns.engines or available_engines()
    have = available_engines(every=True)
    missing = [e for e in engines if e not in have]
    if missing:
        p.error(f"--engines: {', '.join(missing)} not available here; this rankwise offers "
                f"{', '.join(have)}")
    if ns.rounds < 1 or (ns.iters is not None and ns.iters < 1) or ns.round_time <= 0:
        p.error("--rounds and --iters must be >= 1 and --round-time > 0")
    for flag, path in (("--plot", ns.plot), ("--json", ns.json)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            p.error(f"{flag}: folder {folder} does not exist")
    if ns.plot and not _has("matplotlib"):
        p.error(PLOT_HINT)
    gloo = bool(ns.gloo)
    if gloo and not _has("torch"):
        gloo = False
        # said once: by the parent, or under mpirun by rank 0 (which prints the table)
        if not ns.worker and os.environ.get("OMPI_COMM_WORLD_RANK",
                                            os.environ.get("PMI_RANK", "0")) == "0":
            _note("torch is not installed: gloo columns skipped (pip install 'rankwise[torch]')")
    pattern = _pattern(p, ns, gloo)
    mpi = bool(ns.mpi) if ns.mpi is not None else (_under_mpirun() and _has("mpi4py"))
    if mpi and not _under_mpirun():
        p.error("--mpi: MPI needs the ranks started by mpirun: mpirun -n 4 rankwise bench ...")
    if mpi and not _has("mpi4py"):
        p.error("--mpi: mpi4py is not installed (pip install mpi4py)")
    if ns.mpi is None and not worker and not _under_mpirun():
        _note("MPI columns skipped: start under mpirun to include them "
              "(mpirun -n 4 rankwise bench ...)")
    return WorkerConfig(ops=tuple(ops), sizes=tuple(ns.sizes), engines=tuple(engines),
                        rounds=ns.rounds, iters=ns.iters, round_time=ns.round_time,
                        gloo=gloo, mpi=mpi, pattern=pattern)


def _pattern(p: argparse.ArgumentParser, ns: argparse.Namespace, gloo: bool) -> Pattern:
    """``--pattern``/``--skew``, checked together: a skew only means something to
    ``skewed``, and the side calls of ``interleaved`` and ``stopflag`` run on gloo."""
    if ns.skew is not None and ns.pattern != "skewed":
        p.error("--skew only applies to --pattern skewed")
    skew = 100.0 if ns.skew is None else ns.skew
    if not 0 <= skew <= 1e6:
        p.error(f"--skew: {ns.skew:g} us is outside 0..1000000")
    if Pattern(ns.pattern).has_side and not gloo:
        p.error(f"--pattern {ns.pattern} calls gloo between the timed calls: it needs torch "
                "and gloo (drop --no-gloo, pip install 'rankwise[torch]')")
    return Pattern(ns.pattern, skew if ns.pattern == "skewed" else 0.0)


def _worker_argv(cfg: WorkerConfig, raw_out: str) -> list[str]:
    """The command line a launched rank gets: the checked configuration, spelled out."""
    argv = ["--worker", "--raw-out", raw_out, "--ops", ",".join(cfg.ops),
            "--sizes", ",".join(str(s) for s in cfg.sizes), "--engines", ",".join(cfg.engines),
            "--rounds", str(cfg.rounds), "--round-time", str(cfg.round_time),
            "--mpi" if cfg.mpi else "--no-mpi", "--pattern", cfg.pattern.name]
    if cfg.pattern.name == "skewed":
        argv += ["--skew", repr(cfg.pattern.skew_us)]
    if cfg.iters is not None:
        argv += ["--iters", str(cfg.iters)]
    if not cfg.gloo:
        argv.append("--no-gloo")
    return argv


def _launch(cfg: WorkerConfig, n: int) -> dict[str, Any] | None:
    """One job of ``n`` ranks through ``rankwise run``'s machinery; rank 0's numbers."""
    # The ranks must import this very rankwise, also from a plain checkout (the wrapper in
    # benchmarks/ puts src/ on sys.path only for itself); run_job passes os.environ on.
    import rankwise

    from ..launch.job import JobOptions, run_job

    src = os.path.dirname(os.path.dirname(os.path.abspath(rankwise.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    if src not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (src, path) if x)
    with tempfile.TemporaryDirectory(prefix="rankwise-bench-") as tmp:
        raw = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-u", "-m", "rankwise.bench.run", *_worker_argv(cfg, raw)]
        # checks="off": torch's gloo is the reference here, so it must stay gloo
        code = run_job(JobOptions(cmd=cmd, nproc=n, prefix=False, timeout=300.0,
                                  token=settings.text("RANKWISE_TOKEN"), checks="off"))
        if code != 0 or not os.path.exists(raw):
            _note(f"the {n}-rank job failed (exit code {code}); its output is above")
            return None
        with open(raw, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
            return result


def _report(runs: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    print("\n".join(format_tables(runs)), flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "runs": runs}, f, indent=1)
        _note(f"raw numbers written to {ns.json}")
    if ns.plot:
        plot(runs, ns.plot)
        _note(f"plot written to {ns.plot}")


def main(argv: Sequence[str] | None = None) -> int:
    """``rankwise bench [options]``; returns the exit code."""
    p = _parser()
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.from_json:
        return _rerender(p, ns)
    worker = ns.worker or _under_mpirun()
    cfg = _check(p, ns, worker)
    if worker:
        return _work(p, ns, cfg)
    runs = []
    for n in ns.nproc or (2,):
        result = _launch(cfg, n)
        if result is None:
            return 1
        runs.append(result)
    _report(runs, ns)
    return 0


def _rerender(p: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``--from-json``: the saved runs of one or more files, reported as one (and, with
    ``--json``, merged into one file)."""
    if ns.plot and not _has("matplotlib"):
        p.error(PLOT_HINT)
    runs: list[dict[str, Any]] = []
    for path in ns.from_json:
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as exc:
            p.error(f"--from-json: cannot read {path}: {exc}")
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            p.error(f"--from-json: {path} is not a rankwise bench file ({FORMAT})")
        runs += saved["runs"]
    _report(runs, ns)
    return 0


def _work(p: argparse.ArgumentParser, ns: argparse.Namespace, cfg: WorkerConfig) -> int:
    """Inside the job: measure; rank 0 hands the numbers back (launched) or reports
    them itself (mpirun, where no parent is waiting)."""
    from ..launch.env import require_env
    from .worker import run_worker

    n = require_env(os.environ).world_size
    if ns.nproc is not None and ns.nproc != (n,):
        p.error(f"-n {','.join(map(str, ns.nproc))} disagrees with the job's {n} ranks "
                "(under mpirun, leave -n out or give mpirun's count)")
    result = run_worker(cfg)
    if result is None:
        return 0
    if ns.raw_out:
        with open(ns.raw_out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    else:
        _report([result], ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
