"""A worker for the launcher tests; behaviour chosen by flags, no collectives needed.

Every rank: installs the worker hooks (the core does this at ``import rankwise`` once it
exists), dumps its environment to OUT/env_<rank>.json, records its pid (and a grandchild's),
prints ``READY <rank>``, then waits on the launcher's store for a key nobody sets (bounded by
--wait) -- the stand-in for a blocking collective.  Its ``finally`` block writes
OUT/finally_<rank>.  ``--fail-rank R --mode M`` makes rank R fail after printing READY.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

from rankwise.launch.worker import install_worker_hooks
from rankwise.store import TCPStore

install_worker_hooks()

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--mode", default="raise")
parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for 'release'")
parser.add_argument("--grandchild", action="store_true")
parser.add_argument("--fail-once", action="store_true", help="fail only on the first attempt")
args = parser.parse_args()

rank = int(os.environ["RANK"])
out = args.out


def write(name: str, text: str) -> None:
    with open(os.path.join(out, name), "w") as fh:
        fh.write(text)


attempt = os.environ["RANKWISE_RESTART_COUNT"]
write(f"env_{rank}_{attempt}.json", json.dumps(dict(os.environ)))
write(f"pid_{rank}_{attempt}", str(os.getpid()))
if args.grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    write(f"pid_{rank}_{attempt}_grandchild", str(child.pid))

store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                 timeout=timedelta(seconds=30))
try:
    print(f"READY {rank}", flush=True)
    if store.add(f"ready/{attempt}", 1) == int(os.environ["WORLD_SIZE"]):
        store.set(f"ready/{attempt}/all", "1")
    failing = rank == args.fail_rank and not (args.fail_once and attempt != "0")
    if failing:
        store.wait([f"ready/{attempt}/all"], timeout=timedelta(seconds=20))
        if args.mode == "raise":
            raise ValueError(f"boom from rank {rank}")
        if args.mode == "exit3":
            sys.exit(3)
        if args.mode in ("sigkill", "sigstop"):
            os.kill(os.getpid(), getattr(signal, args.mode.upper()))
    if args.wait:
        store.wait(["release"], timeout=timedelta(seconds=args.wait))
finally:
    write(f"finally_{rank}_{attempt}", "1")
