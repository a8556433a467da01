"""Faults between two simulated hosts: rankwise run vs torchrun + gloo, side by side.

For each fault (silent partition, node SIGKILL, launcher SIGKILL) a 2-host x 2-rank job of
each system is started in fresh network namespaces (tests/_netns.py; needs root), the fault
is injected once every rank works, and the script prints the seconds from the fault to the
first and the last rank that raised, to each launcher's exit (">CAP" when it did not exit
within ``--cap`` seconds, then killed), and the processes still running in each namespace
just before the teardown. Default settings for both (rankwise: heartbeat timeout 15 s).

    python benchmarks/faults.py --cap 60
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _netns import SimHosts, unavailable
from _netns_job import Job

GLOO = str(Path(__file__).resolve().parent / "_faults_gloo_worker.py")


def _fault(name: str, hosts: SimHosts, job: Job) -> None:
    if name == "partition":
        hosts.cut(1)
    elif name == "node-kill":
        for pid in hosts.pids(1):
            os.kill(pid, signal.SIGKILL)
    elif name == "launcher-kill":
        job.launchers[1].send_signal(signal.SIGKILL)


def _one(system: str, fault: str, cap: float) -> str:
    with SimHosts(2) as hosts:
        env = {"GLOO_SOCKET_IFNAME": "eth0", "RANKWISE_HEARTBEAT_TIMEOUT": ""}
        job = Job(hosts, ["loop", "600"], env, worker=GLOO if system == "torchrun" else None)
        if not job.wait_for(lambda ls: sum(x.startswith("ready ") for x in ls) == 4, 120):
            return f"{system:9} {fault:14} did not start:\n{job.text()[-2000:]}"
        _fault(fault, hosts, job)
        start = time.monotonic()
        exits = [f">{cap:g}", f">{cap:g}"]
        while time.monotonic() < start + cap and any(x.startswith(">") for x in exits):
            for node in range(2):  # polled: a benchmark's 0.1 s resolution is enough
                if exits[node].startswith(">") and job.launchers[node].poll() is not None:
                    exits[node] = f"{time.monotonic() - start:.1f}"
            time.sleep(0.1)
        raised = sorted(t - start for t, _, line in job.lines if line.startswith("raised "))
        left = [len(hosts.pids(i)) for i in range(2)]
        first = f"{raised[0]:.2f}" if raised else "-"
        last = f"{raised[-1]:.2f} ({len(raised)} ranks)" if raised else "-"
        return (f"{system:9} {fault:14} first raise {first:>6} s, last {last:>16}, "
                f"launcher exits node0 {exits[0]:>6} node1 {exits[1]:>6}, "
                f"processes left h0/h1 {left[0]}/{left[1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cap", type=float, default=60.0)
    p.add_argument("--faults", default="partition,node-kill,launcher-kill")
    p.add_argument("--systems", default="rankwise,torchrun")
    a = p.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"no simulated hosts: {why}")
    for fault in a.faults.split(","):
        for system in a.systems.split(","):
            print(_one(system, fault, a.cap), flush=True)


if __name__ == "__main__":
    main()
