"""Init time with one host's rendezvous store behind a slow link: rankwise vs torch gloo.

Two simulated hosts (tests/_netns.py; needs root), 2 ranks each, node 0 hosting the store.
Host 1 reaches the store only through a proxy that delays each chunk, each way, by
``--delay`` ± ``--jitter`` seconds (order kept; no loss; this kernel has no netem), so every
serial store round trip of host 1's launcher and ranks costs about twice that. The data connections between the hosts are not delayed: this measures what init's
store round trips cost, not the whole of a slow link. Rounds alternate the implementations
(``--trees`` adds rankwise source trees, e.g. an older checkout, as further columns); each
prints the slowest rank's init + first barrier, median [min..max] over ``--rounds``.

    python benchmarks/slow_store_init.py --rounds 3 --trees old=/tmp/old/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _netns

HERE = Path(__file__).resolve().parent


def _one(hosts: _netns.SimHosts, impl: str, tree: str, port: int, args: argparse.Namespace,
         ) -> list[float]:
    proxy = hosts.popen(1, [sys.executable, str(HERE / "_delay_proxy.py"), f"127.0.0.1:{port + 1}",
                            f"{hosts.addr(0)}:{port}", str(args.delay), str(args.jitter)],
                        stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "listening"
        env = {**os.environ, "RANKWISE_TOKEN": "bench", "GLOO_SOCKET_IFNAME": "eth0"}
        if tree:
            env["PYTHONPATH"] = tree
        launchers = []
        for node in range(2):
            addr, p = (hosts.addr(0), port) if node == 0 else ("127.0.0.1", port + 1)
            launcher = ["torch.distributed.run"] if impl == "gloo" else ["rankwise", "run"]
            node_env = dict(env)
            if node == 1:
                node_env["RANKWISE_BIND_ADDR"] = hosts.addr(1)
            launchers.append(hosts.popen(node, [
                sys.executable, "-m", *launcher, "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", str(node), "--master-addr", addr, "--master-port", str(p),
                str(HERE / "_init_worker.py"), "gloo" if impl == "gloo" else "rankwise"],
                env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        times = []
        for launcher in launchers:
            out, _ = launcher.communicate(timeout=args.cap)
            times += [float(line.split()[-1]) for line in out.splitlines()
                      if line.startswith("init ")]
            if launcher.returncode != 0:
                print(out[-3000:], file=sys.stderr)
        return times
    finally:
        proxy.kill()
        proxy.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.3, help="seconds, each way")
    p.add_argument("--jitter", type=float, default=0.1)
    p.add_argument("--cap", type=float, default=120.0, help="seconds a run may take")
    p.add_argument("--trees", default="", help="name=src_dir,... further rankwise trees")
    args = p.parse_args()
    impls = [("rankwise", "")] + [tuple(t.split("=", 1)) for t in args.trees.split(",") if t] \
        + [("gloo", "")]
    why = _netns.unavailable()
    if why:
        print(f"no simulated hosts: {why}", file=sys.stderr)
        return 1
    _netns.remove_stale()
    results: dict[str, list[float]] = {name: [] for name, _ in impls}
    with _netns.SimHosts(2) as hosts:
        port = 29700
        for r in range(args.rounds):
            for name, tree in impls:
                times = _one(hosts, "gloo" if name == "gloo" else "rankwise", tree, port, args)
                port += 2
                slowest = max(times) if len(times) == 4 else float("nan")
                results[name].append(slowest)
                print(f"round {r} {name}: slowest rank {slowest:.2f} s ({len(times)} ranks)",
                      flush=True)
    gloo = results["gloo"]
    for name, values in results.items():
        ratios = [v / g for v, g in zip(values, gloo, strict=True)]
        print(f"{name:10s} init+barrier {statistics.median(values):.2f} s "
              f"[{min(values):.2f}..{max(values):.2f}]  vs gloo {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}..{max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
