"""A worker for `rankwise run` that injects one fault, chosen by environment variables.

FAULT_RANK   the rank that misbehaves (the others are the survivors)
FAULT_KIND   raise | exit0 | exit3 | sigkill | sigstop | destroy | grandchild | none
FAULT_PLACE  init | all_reduce | recv | rzf | ddp
FAULT_TIMEOUT  the group timeout in seconds (default 6)
FAULT_OUT    a directory: each rank writes result_<rank>.json there (what it raised, when)

A survivor records the class (and its MRO) of what it raised and how long it waited
from entering the faulty place to the raise, so the test can check both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
FAULT_RANK = int(os.environ.get("FAULT_RANK", "-1"))
KIND = os.environ.get("FAULT_KIND", "none")
PLACE = os.environ.get("FAULT_PLACE", "all_reduce")
TIMEOUT = float(os.environ.get("FAULT_TIMEOUT", "6"))
OUT = os.environ.get("FAULT_OUT", "")


def record(data: dict[str, Any]) -> None:
    if not OUT:
        return
    data["rank"] = RANK
    path = os.path.join(OUT, f"result_{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def fault() -> None:
    """Misbehave (on FAULT_RANK only)."""
    if RANK != FAULT_RANK:
        return
    record({"faulty": True, "kind": KIND})
    sys.stdout.flush()
    if KIND == "raise":
        raise ValueError(f"injected fault on rank {RANK} at {PLACE}")
    if KIND == "exit0":
        sys.exit(0)
    if KIND == "exit3":
        os._exit(3)
    if KIND == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # resumed (the launcher's teardown sends SIGCONT with SIGTERM)
    if KIND == "destroy":
        import rankwise as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0)  # an early leaver: it never takes part again
    if KIND == "grandchild":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"grandchild started by rank {RANK}", flush=True)
        while True:
            signal.pause()


def main() -> None:
    import numpy as np

    import rankwise as dist

    entered = time.monotonic()
    state = {"place": "init"}
    try:
        if PLACE == "init":
            fault()
        entered = time.monotonic()
        dist.init_process_group("tcp", timeout=TIMEOUT)
        if PLACE == "all_reduce":
            x = np.ones(4, np.float32)
            for _ in range(2):
                dist.all_reduce(x)
            fault()
            state["place"] = "all_reduce"
            entered = time.monotonic()
            dist.all_reduce(x)
        elif PLACE == "recv":
            x = np.ones(4, np.float32)
            dist.all_reduce(x)
            if RANK == FAULT_RANK:
                fault()
                for r in range(WORLD):
                    if r != RANK:
                        dist.send(x, r)
            else:
                state["place"] = "recv"
                entered = time.monotonic()
                dist.recv(x, FAULT_RANK)
        elif PLACE == "rzf":
            dist.barrier()
            state["place"] = "rzf"
            entered = time.monotonic()
            if RANK != 0:
                fault()
            with dist.rank_zero_first():
                if RANK == 0:
                    fault()
        elif PLACE == "ddp":
            import torch

            from rankwise.nn import DistributedDataParallel

            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Linear(8, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                opt.zero_grad()
                loss = model(torch.randn(4, 8)).sum()
                if step == 2:
                    fault()
                    state["place"] = "ddp"
                    entered = time.monotonic()
                loss.backward()
                opt.step()
        dist.barrier()  # the survivors must not finish before noticing the fault
        record({"ok": True, "place": state["place"]})
        dist.destroy_process_group()
    except BaseException as exc:
        elapsed = time.monotonic() - entered
        report = getattr(exc, "report", "")
        record({"ok": False, "place": state["place"], "type": type(exc).__name__,
                "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:3000],
                "elapsed": elapsed, "report": bool(report),
                "traceback": traceback.format_exc()[-3000:]})
        raise


if __name__ == "__main__":
    main()
