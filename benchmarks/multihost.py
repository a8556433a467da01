"""``rankwise bench`` across two simulated hosts: rankwise (tcp and tiers engines) vs torch gloo.

Two network namespaces joined by a bridge (tests/_netns.py; needs root), one
``rankwise run`` launcher per host with ``--nproc`` ranks each; every rank runs the bench
worker, so both libraries cross the veth link in the same processes, in alternating
rounds, as on one host, one pass per rankwise engine (``--engines``, default ``tcp,tiers``).
Prints each engine's and size's median per-call time and the rankwise/gloo
ratio with the lowest and highest single-round ratio; ``--json`` keeps the raw numbers.
The namespaces are named ``<--ns-prefix><pid>-...`` and removed on exit.

    python benchmarks/multihost.py --sizes 4,1K,1M,16M
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _netns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--sizes", default="4,1K,1M,16M")
    p.add_argument("--ops", default="all_reduce", help="comma list, as rankwise bench's")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-time", type=float, default=0.1)
    p.add_argument("--pattern", default="lockstep")
    p.add_argument("--engines", default="tcp,tiers",
                   help="rankwise engines, a pass each (default tcp,tiers: flat over tcp, and "
                        "shared memory within each host with tcp between them)")
    p.add_argument("--json", help="write the raw numbers here")
    p.add_argument("--ns-prefix", default="bench-",
                   help="namespace name prefix (not the tests' own: their sweep stays theirs)")
    ns = p.parse_args()
    _netns.PREFIX = ns.ns_prefix
    why = _netns.unavailable()
    if why:
        print(f"multihost: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rankwise-multihost-") as tmp:
        raw = ns.json or os.path.join(tmp, "raw.json")
        env = {**os.environ, "RANKWISE_TOKEN": "multihost", "GLOO_SOCKET_IFNAME": "eth0"}
        with _netns.SimHosts(2) as hosts:
            procs = [hosts.popen(node, [
                sys.executable, "-m", "rankwise", "run", "--nnodes", "2",
                "--nproc-per-node", str(ns.nproc), "--node-rank", str(node),
                "--master-addr", hosts.addr(0), "--master-port", "29611",
                "-m", "rankwise.bench.run", "--worker", "--raw-out", raw, "--engines", ns.engines,
                "--no-mpi", "--ops", ns.ops, "--sizes", ns.sizes, "--rounds", str(ns.rounds),
                "--round-time", str(ns.round_time), "--pattern", ns.pattern],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node in range(2)]
            for proc in procs:
                try:
                    out, _ = proc.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate()
                if proc.returncode:
                    print(out.decode(errors="replace")[-4000:], file=sys.stderr)
        if not os.path.exists(raw):
            print("multihost: the job wrote no numbers (its output is above)", file=sys.stderr)
            return 1
        with open(raw, encoding="utf-8") as f:
            run = json.load(f)
    print(f"2 hosts x {ns.nproc} ranks, tcp between hosts, pattern {ns.pattern}: "
          "median us per call, rankwise/gloo (lowest-highest round)")
    for p in run["passes"]:
        engine = p["engine"]
        for cell in p["cells"]:
            s = cell["seconds"]
            mine, gloo = s[f"rankwise-{engine}"], s["gloo"]
            pairs = [a / b for a, b in zip(mine, gloo)]
            print(f"{engine:6s} {cell['op']:12s} {cell['bytes']:>10d} B  rankwise "
                  f"{statistics.median(mine) * 1e6:9.0f}  gloo {statistics.median(gloo) * 1e6:9.0f}"
                  f"  ratio {statistics.median(mine) / statistics.median(gloo):.2f} "
                  f"({min(pairs):.2f}-{max(pairs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
