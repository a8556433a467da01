"""What the torch backend costs: ``torch.distributed.all_reduce`` on backend "rankwise" vs
``rankwise.all_reduce``, same processes, same run, same rankwise group underneath.

The difference is torch's own Python wrapper (argument checks, the C++ dispatcher, the
trampoline back into Python) plus the backend's translation and its completed ``Work``.
Blocks of each are interleaved (alternating which goes first) so machine noise hits both
alike; per block the slowest rank counts (a collective is as fast as its slowest rank),
then the median over blocks. Target: torch/rankwise <= 1.20 on a 4-byte all_reduce.

A third column times torch's wrapper alone: ``torch.distributed.all_reduce`` on a group
whose backend returns at once (no communication). That is the floor no backend can go
under; "beyond floor" is what rankwise's backend adds on top of it and of its own call.

    python benchmarks/torch_backend.py                  # 2 ranks
    python benchmarks/torch_backend.py --ranks 2,4 --iters 2000 --blocks 10
"""

from __future__ import annotations

import statistics
from typing import Any

from _blocks import parse_args, run_blocks, slowest_per_block, time_blocks

_NOOP = "rankwise-bench-noop"


def _noop_group(tdist: Any) -> Any:
    """A group of every rank whose all_reduce does nothing: torch's wrapper cost alone."""

    class NoOp(tdist.ProcessGroup):  # type: ignore[misc,name-defined]
        def allreduce(self, tensors: Any, opts: Any = None) -> None:
            return None

        def getBackendName(self) -> str:
            return _NOOP

    if _NOOP not in tdist.Backend.backend_list:
        tdist.Backend.register_backend(_NOOP, lambda store, rank, size, timeout:
                                       NoOp(rank, size), devices=["cpu"])
    return tdist.new_group(backend=_NOOP)


def _bench(rank: int, world: int, iters: int, blocks: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as tdist

    import rankwise
    import rankwise.torch  # registers the "rankwise" torch backend
    from rankwise.api.world import current
    from rankwise.store.torch_views import TorchStoreView

    # rankwise is initialized by run_ranks; torch's default group then wraps its world
    tdist.init_process_group("rankwise", store=TorchStoreView(current().store), rank=rank,
                             world_size=world)
    t = torch.ones(1)  # 4 bytes
    noop = _noop_group(tdist)
    ops = {"rankwise": lambda: rankwise.all_reduce(t), "torch": lambda: tdist.all_reduce(t),
           "floor": lambda: tdist.all_reduce(t, group=noop)}
    times = time_blocks(ops, iters, blocks, rankwise.barrier, warmup=300)
    tdist.destroy_process_group()  # leaves rankwise's world to run_ranks (not torch's)
    return times


def main() -> None:
    args = parse_args(__doc__, ranks="2")
    print(f"{'ranks':>5} {'rankwise (us)':>13} {'torch (us)':>10} {'torch/rankwise':>14} "
          f"{'best rw':>8} {'best torch':>10} {'best ratio':>10} {'floor (us)':>10} "
          f"{'beyond floor':>12}")
    for n in [int(x) for x in args.ranks.split(",")]:
        per_rank = run_blocks(_bench, n, (args.iters, args.blocks))
        rw, tw, fl = (slowest_per_block(per_rank, k) for k in ("rankwise", "torch", "floor"))
        rw_m, tw_m, fl_m = (statistics.median(x) for x in (rw, tw, fl))
        print(f"{n:>5} {rw_m:>13.1f} {tw_m:>10.1f} {tw_m / rw_m:>14.3f} {min(rw):>8.1f} "
              f"{min(tw):>10.1f} {min(tw) / min(rw):>10.3f} {fl_m:>10.1f} "
              f"{tw_m - rw_m - fl_m:>10.1f}us")


if __name__ == "__main__":
    main()
