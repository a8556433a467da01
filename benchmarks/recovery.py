"""Recovery in place against recovery by restart: seconds from a rank's SIGKILL to training
again, on one host, 4 ranks of ``examples/recovery_ddp.py`` (DDP, rank 2 dies at step 10).

Modes, alternated within each repeat so that the machine's load hits all alike:
- ``shrink``: ``rankwise run --on-failure=continue``; the survivors' return from shrink
  and the state restore (the ``resumed ... (t=)`` lines; the slowest survivor counts);
- ``grow``: the same with ``--respawn 1 --grow``; until the replacement is admitted and
  the job is at 4 ranks again (the ``admitted ... (t=)`` lines);
- ``restart``: ``rankwise run --max-restarts 1``, the survivors not recovering
  (``--no-recover``: their PeerFailure ends them); until the restarted job's rank 0 is at
  step 0 again (processes ended, started, torch imported, rendezvous, model rebuilt);
- ``torchrun``: the same restart under ``torchrun --max-restarts 1``.

    python benchmarks/recovery.py --repeats 3 [--transport tcp|shm]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "recovery_ddp.py")
ARGS = ["--steps", "16", "--kill-at", "10"]
MODES = {
    "shrink": (["-m", "rankwise", "run", "--on-failure=continue"], [],
               r"resumed at step \d+ .*\(t=([0-9.]+)\)"),
    "grow": (["-m", "rankwise", "run", "--on-failure=continue", "--respawn", "1"], ["--grow"],
             r"admitted ranks .*\(t=([0-9.]+)\)"),
    "restart": (["-m", "rankwise", "run", "--max-restarts", "1"], ["--no-recover"],
                r"at step 0 with 4 ranks \(t=([0-9.]+)\)"),
    "torchrun": (["-m", "torch.distributed.run", "--max-restarts", "1"], ["--no-recover"],
                 r"at step 0 with 4 ranks \(t=([0-9.]+)\)"),
}


def once(mode: str, transport: str) -> float | None:
    launcher, extra, pattern = MODES[mode]
    cmd = [sys.executable, *launcher, "--nproc-per-node", "4", EXAMPLE, *ARGS, *extra]
    env = dict(os.environ, RANKWISE_TRANSPORT=transport,
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    text = done.stdout + done.stderr
    killed = re.search(r"SIGKILL to itself .*\(t=([0-9.]+)\)", text)
    after = [float(t) for t in re.findall(pattern, text)]
    if killed is None or not after:
        print(f"  {mode}: no timing (exit {done.returncode}):\n{text[-1500:]}", file=sys.stderr)
        return None
    t0 = float(killed.group(1))
    later = [t for t in after if t > t0]  # restart: the first attempt's "step 0" came before
    return max(later) - t0 if mode in ("shrink", "grow") else min(later) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            took = once(mode, args.transport)
            if took is not None:
                seconds[mode].append(took)
            print(f"repeat {r}: {mode}: {took if took is None else f'{took:.2f}s'}", flush=True)
    print(f"\nkill -> training again, {args.transport}, 4 ranks, {args.repeats} repeats")
    base = statistics.median(seconds["shrink"]) if seconds.get("shrink") else None
    for mode, got in seconds.items():
        if not got:
            print(f"  {mode:9s} no result")
            continue
        med = statistics.median(got)
        ratio = f"  {med / base:5.1f}x shrink" if base else ""
        print(f"  {mode:9s} median {med:6.2f}s  min {min(got):6.2f}s  max {max(got):6.2f}s"
              f"{ratio}")


if __name__ == "__main__":
    main()
