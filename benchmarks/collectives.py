"""rankwise vs torch gloo (and MPI under mpirun), side by side in the same processes.

This benchmark became the ``rankwise bench`` command (``src/rankwise/launch/bench.py``);
this file only keeps the old command lines working and passes everything else through,
so the two can never measure differently.

    python benchmarks/collectives.py                      # = rankwise bench -n 2,4
    python benchmarks/collectives.py --ranks 2 --ops all_reduce,broadcast --max-size 16M
    python benchmarks/collectives.py -n 4 --sizes 4..16M --plot bench.png   # new spellings

Old options: ``--ranks`` is ``-n``; ``--min-size``/``--max-size`` become ``--sizes LO..HI``
(powers of 4); ``--budget`` (seconds per cell) becomes ``--round-time`` (per round).
"""

from __future__ import annotations

import argparse
import os
import sys


def translate(argv: list[str]) -> list[str]:
    """Old spellings -> ``rankwise bench`` arguments; unknown ones pass through unchanged."""
    old = argparse.ArgumentParser(add_help=False)
    old.add_argument("--ranks")
    old.add_argument("--min-size", default="4")
    old.add_argument("--max-size", default=None)
    old.add_argument("--budget", type=float, default=None)
    old.add_argument("--rounds", type=int, default=5)
    ns, rest = old.parse_known_args(argv)
    out = ["--rounds", str(ns.rounds)]
    if ns.ranks:
        out += ["-n", ns.ranks]
    elif not any(a in ("-n", "--nproc") or a.startswith("--nproc=") for a in rest):
        out += ["-n", "2,4"]
    if ns.max_size or ns.min_size != "4":
        out += ["--sizes", f"{ns.min_size}..{ns.max_size or '64M'}"]
    if ns.budget is not None:
        out += ["--round-time", str(ns.budget / ns.rounds)]
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from rankwise.bench.run import main as bench_main

    return bench_main(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
