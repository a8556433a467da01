"""rankwise's own host CPU per device call, at two ranks with the checks on, over torch's.

    python benchmarks/device_path.py [--calls N] [--rounds R] [--worlds 1,2]

What runs: a real rankwise job of ``--worlds`` processes over loopback
(``rankwise.testing.run_ranks``), checks as ``RANKWISE_CHECK`` says (default: on). The
default group's device engine is rankwise's NCCL engine (``TorchEngine``, ``DeviceTensors``,
the real ``CudaStreams``) over a ``ProcessGroupNCCL`` stand-in and ``torch.cuda`` fakes
that cost nothing (``_fake_nccl``), so CPU tensors take the device path and the calling
thread's CPU time (``time.thread_time``) is rankwise's own bookkeeping:

- ``rankwise API``: blocking ``rankwise.all_reduce`` of 4 bytes;
- ``torch API``: ``torch.distributed.all_reduce`` of 4 bytes on backend "rankwise",
  less the reference (rankwise's part only);
- ``1 MiB``: DDP's bucket path: a 1 MiB tensor handed to the backend's ``allreduce``
  as DDP's reducer hands it (its options' ``asyncOp`` left true), then the work's
  ``wait()`` (DDP waits on the work's future at the end of backward, long after it is
  done; ``wait()`` settles that future without timing the async worker's hand-off);
- ``async+wait``: ``rankwise.all_reduce(t, async_op=True)`` then ``wait()``.

Each is divided by the reference, timed in the same processes and rounds: torch's own
``torch.distributed.all_reduce`` into a ``ProcessGroup`` subclass whose ``allreduce``
returns one completed ``Work`` (made once: the dispatch every backend pays, and nothing
else). The cases alternate in short rounds (forward, then reversed), each after a
barrier, so that a case and the reference see the same machine; per round the ranks'
mean counts, and each ratio is taken within a round; the figures are medians over
rounds, with quartiles and range.
Two cases more are shown, not rated: a 1 MiB tensor through ``rankwise.all_reduce`` and
``torch.distributed.all_reduce(async_op=True)`` then ``wait()``. The last line:

    device path per call (world 2, checks on): rankwise API 1.4x, torch API 1.5x, 1 MiB 1.8x, async+wait 1.9x torch's dispatch (2.7 us)

A shared machine makes absolute microseconds meaningless between runs; the ratios are
taken within one run. Only rankwise's public API is timed (the fake is installed through
its internals, in ``_fake_nccl.install``), so the script can time older trees: copy
this file and ``_fake_nccl.py`` into one's ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # _blocks (which puts this tree's src first), _fake_nccl

from _blocks import SRC, run_blocks, time_blocks

REFERENCE = "torch's dispatch"
#: the rated cases, in the last line's order: (label, key, less the reference)
RATED = (("rankwise API", "rankwise API", False), ("torch API", "torch API", True),
         ("1 MiB", "1 MiB, DDP's bucket", False), ("async+wait", "async+wait", False))
#: shown, not rated
EXTRA = ("1 MiB, rankwise API", "torch API async+wait")
MIB = 1 << 20


def _nothing_group(rank: int, world: int) -> Any:
    """A torch group whose ``allreduce`` returns a completed ``Work`` and does nothing."""
    import torch.distributed as tdist

    class Done(tdist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    done = Done()

    class Nothing(tdist.ProcessGroup):
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]
            return done

        def getBackendName(self) -> str:
            return "nothing"

    return Nothing(rank, world)  # type: ignore[call-arg]


def _ops(rank: int, world: int) -> dict[str, Callable[[], object]]:
    """Every case of one rank, by name (rankwise and torch's backend initialized)."""
    import torch
    import torch.distributed as tdist

    import rankwise

    t = torch.ones(1)
    big = torch.ones(MIB // 4)
    nothing = _nothing_group(rank, world)
    backend = tdist.group.WORLD
    assert backend is not None
    bucket_opts = tdist.AllreduceOptions()  # as DDP's reducer: asyncOp left at its default

    def bucket() -> None:
        backend.allreduce([big], bucket_opts).wait()

    def rw_async() -> None:
        rankwise.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]

    def torch_async() -> None:
        tdist.all_reduce(t, async_op=True).wait()

    return {REFERENCE: lambda: tdist.all_reduce(t, group=nothing),
            "rankwise API": lambda: rankwise.all_reduce(t),
            "torch API": lambda: tdist.all_reduce(t),
            "1 MiB, DDP's bucket": bucket,
            "async+wait": rw_async,
            "1 MiB, rankwise API": lambda: rankwise.all_reduce(big),
            "torch API async+wait": torch_async}


def _bench(rank: int, world: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """One rank: the fake device engine, torch's default group on backend "rankwise",
    then every case in alternating rounds (caller CPU seconds per call, per round)."""
    import torch.distributed as tdist
    from _fake_nccl import install

    import rankwise
    import rankwise.torch  # registers backend "rankwise"

    fake = install()
    # rankwise is initialized by run_ranks; torch's default group reuses its world
    store = tdist.HashStore()  # type: ignore[attr-defined]
    tdist.init_process_group("rankwise", store=store, rank=rank, world_size=world)
    try:
        ops = _ops(rank, world)
        times = time_blocks(ops, calls, rounds, rankwise.barrier, warmup=min(calls, 200),
                            clock="cpu")
    finally:
        rankwise.barrier()
        tdist.destroy_process_group()  # leaves rankwise's world to run_ranks
    want = (len(ops) - 1) * calls * rounds  # every case but the reference
    if fake.calls < want:  # a moved seam must not time the host engine unnoticed
        raise RuntimeError(f"the fake NCCL group saw {fake.calls} calls, not {want}: the "
                           "cases no longer take the device path")
    return times


def _spread(xs: list[float], unit: str) -> str:
    """Median, quartiles and range of ``xs`` (the rounds')."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return (f"{q[1]:.2f}{unit} (quartiles {q[0]:.2f}-{q[2]:.2f}, "
            f"range {min(xs):.2f}-{max(xs):.2f})")


def ratios(us: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each rated case over the reference, per round (``us``: microseconds per call,
    per round, by case name)."""
    ref = us[REFERENCE]
    out = {}
    for label, key, less in RATED:
        out[label] = [(x - r if less else x) / r for x, r in zip(us[key], ref, strict=True)]
    return out


def summary(world: int, checks: str, us: dict[str, list[float]]) -> str:
    """The one-line verdict for ``world`` ranks."""
    rated = ratios(us)
    parts = ", ".join(f"{label} {statistics.median(rated[label]):.1f}x" for label, _, _ in RATED)
    return (f"device path per call (world {world}, checks {checks}): {parts} {REFERENCE} "
            f"({statistics.median(us[REFERENCE]):.1f} us)")


def report(world: int, checks: str, us: dict[str, list[float]]) -> list[str]:
    """The table for ``world`` ranks: each case's microseconds and ratio, with spread."""
    rated = ratios(us)
    mode = os.environ.get("RANKWISE_CHECK", "async")
    lines = [(f"world {world}, checks {checks} ({mode}): caller CPU per call, the ranks' mean "
              "per round; median over rounds")]
    lines.append(f"  {REFERENCE:<22} {_spread(us[REFERENCE], ' us')}")
    for label, key, less in RATED:
        how = " (less the reference)" if less else ""
        lines.append(f"  {key:<22} {_spread(us[key], ' us')}")
        lines.append(f"  {'':<22} {_spread(rated[label], 'x')}{how}")
    for key in EXTRA:
        over = [x / r for x, r in zip(us[key], us[REFERENCE], strict=True)]
        lines.append(f"  {key:<22} {_spread(us[key], ' us')}")
        lines.append(f"  {'':<22} {_spread(over, 'x')}")
    return lines


def measure(world: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per call of every case, per round, the ranks' mean (each rank pays
    the same CPU per call in a ring: the mean is that cost, steadier than the slower)."""
    per_rank = run_blocks(_bench, world, (calls, rounds))
    return {name: [statistics.fmean(r) * 1e6 for r in zip(*(p[name] for p in per_rank))]
            for name in per_rank[0]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per case per round")
    parser.add_argument("--rounds", "--repeats", type=int, default=21)
    parser.add_argument("--worlds", default="1,2",
                        help="world sizes, comma-separated; the last line is world 2's")
    args = parser.parse_args(argv)
    # the ranks' forkserver imports rankwise before it reads sys.path (Python 3.11): this
    # tree's src must come first in its environment too, or it times an installed copy
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    worlds = sorted({int(w) for w in args.worlds.split(",")}, key=lambda w: (w == 2, w))
    if args.calls < 1 or args.rounds < 1 or min(worlds) < 1:
        parser.error("--calls, --rounds and the world sizes must be at least 1")
    checks = "off" if os.environ.get("RANKWISE_CHECK", "").strip().lower() == "off" else "on"
    print(f"{args.calls} calls x {args.rounds} rounds per case, alternated")
    lines = []
    for world in worlds:
        us = measure(world, args.calls, args.rounds)
        print("\n".join(report(world, checks, us)), flush=True)
        lines.append(summary(world, checks, us))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
