"""Seed 000's barrier trap, reproduced — and what rankwise makes of it.

The "rank 0 first" context manager (rank 0 builds the dataset cache, the others wait at
a barrier, rank 0 releases them with a second barrier) is fine when every rank enters
it. ``create_dataloader`` uses it inside; every rank builds the train loader, but only
rank 0 builds the validation loader. Rank 0's extra barrier then pairs with the other
ranks' end-of-epoch barrier (barriers from different code pair silently), and the job
runs on out of step: on torch/gloo it dies ~30 minutes later with "Timed out waiting
... for recv operation". With rankwise it stops at the first collective that cannot
pair (seconds), on every rank, with a report naming the earlier barrier where the
ranks' call stacks diverged: rank 0's, reached via create_dataloader for the
validation loader.

    python -m rankwise run -n 4 examples/barrier_trap.py           # the trap
    python -m rankwise run -n 4 examples/barrier_trap.py --fixed   # the seed's fix
    python -m rankwise run -n 4 examples/barrier_trap.py --safe    # rankwise.rank_zero_first

``--fixed`` is the seed author's fix (pass rank=-1 on the rank-0-only path);
``--safe`` uses ``rankwise.rank_zero_first``, whose barrier only pairs with the same
block on the other ranks, so the trap fails at once, naming itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

import rankwise as dist

MODE = "safe" if "--safe" in sys.argv else "fixed" if "--fixed" in sys.argv else "trap"


@contextmanager
def torch_distributed_zero_first(rank: int) -> Iterator[None]:
    """The hand-written helper of the seed (YOLOv5, Hugging Face examples)."""
    if rank not in [-1, 0]:
        dist.barrier()  # the other ranks wait here for rank 0  @wait-for-rank-0
    yield
    if rank == 0:
        dist.barrier()  # rank 0 releases the others  @release


def build_dataset(name: str, n: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng(0 if name == "train" else 1)
    data = rng.standard_normal((n, 8)).astype(np.float32)
    return data[rank::max(1, dist.get_world_size())] if name == "train" else data


def create_dataloader(name: str, rank: int, n: int) -> list[np.ndarray]:
    if MODE == "safe":
        with dist.rank_zero_first():  # @safe-block
            data = build_dataset(name, n, max(rank, 0))
    else:
        with torch_distributed_zero_first(rank):  # @zero-first-with
            data = build_dataset(name, n, max(rank, 0))
    return [data[i:i + 4] for i in range(0, len(data), 4)]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_loader = create_dataloader("train", rank, 64)
    weights = np.zeros(8, np.float32)
    dist.broadcast(weights, src=0)  # every rank starts from rank 0's weights
    if rank in [-1, 0]:
        # the trap: only rank 0 builds the validation loader, through the same helper
        val_loader = create_dataloader("val", -1 if MODE == "fixed" else rank, 16)  # @val
    for epoch in range(3):
        for batch in train_loader:  # local steps: no communication
            weights -= 0.01 * batch.mean(axis=0)
        dist.barrier()  # wait for every rank to finish the epoch  @end-of-epoch
        dist.all_reduce(weights)  # average the models  @average
        weights /= world
        if rank == 0:
            loss = float(np.mean([np.square(b @ weights).mean() for b in val_loader]))
            print(f"epoch {epoch}: val loss {loss:.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"PASS ({MODE}): every rank finished in step", flush=True)


if __name__ == "__main__":
    main()
