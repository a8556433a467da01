"""Broken (and correct) programs for ``test_diagnosis_catalogue.py``; not tests themselves.

Each case is a function run as ``python tests/test_diagnosis_programs.py CASE`` in one
process per rank (env:// init: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that an
uncaught exception goes through ``sys.excepthook`` exactly as in a user's job. Lines the
tests assert on carry an ``# @marker`` comment; ``line_of`` finds them, so the tests do
not break when this file is edited.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np


def line_of(marker: str, path: str = __file__) -> int:
    """The line number of the line ending in ``# @marker`` (for the tests' assertions)."""
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(f"@{marker}"):
                return i
    raise LookupError(marker)


def _busy(seconds: float) -> None:
    """Pure-Python work that holds the GIL (the I/O thread must still answer)."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for i in range(1000):
            x += i * i


def subset_barrier(dist, rank, world):
    t = np.ones(4, np.float32)
    dist.all_reduce(t)
    if rank != world - 1:
        dist.barrier()  # only some ranks wait here  @subset-barrier
    dist.all_reduce(t)  # @subset-after


def uneven_batches(dist, rank, world):
    grads = np.ones(4, np.float32)
    n_batches = 5 - (rank == 1)  # rank 1's shard has one batch fewer
    for _ in range(n_batches):
        dist.all_reduce(grads)  # @uneven-step
    metric = np.ones(1, np.float32)
    dist.all_reduce(metric)  # @uneven-metric


def _numel() -> int:
    """Element count of the failing calls: NUMEL=262144 and up makes them large messages,
    which the waiting thread reads for itself (transport drive) instead of the I/O thread."""
    return int(os.environ.get("NUMEL", "4"))


def shape(dist, rank, world):
    dist.barrier()
    t = np.ones(_numel() + rank, np.float32)
    dist.all_reduce(t)  # @shape


def dtype(dist, rank, world):
    t = np.ones(4, np.float32 if rank == 0 else np.int64)
    dist.broadcast(t, src=0)  # @dtype
    dist.barrier()  # the root of a broadcast only sends: let it hear about the mismatch


def root(dist, rank, world):
    mine = np.ones(2, np.float32)
    slots = [np.zeros(2, np.float32) for _ in range(world)]
    dist.gather(mine, slots, dst=rank)  # each rank thinks it is the root  @root


def op(dist, rank, world):
    t = np.ones(4, np.float32)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)  # @op


def raises(dist, rank, world):
    t = np.ones(4, np.float32)
    for epoch in range(3):
        if rank == 1 and epoch == 1:
            raise ValueError("corrupt batch in shard 1")  # @raise
        dist.all_reduce(t)  # @raise-step


def exits_early(dist, rank, world):
    t = np.ones(4, np.float32)
    for epoch in range(3):
        if rank == 1 and epoch == 1:
            dist.destroy_process_group()  # @leave
            return
        dist.all_reduce(t)  # @early-step


def killed(dist, rank, world):
    t = np.ones(_numel(), np.float32)
    for epoch in range(3):
        if rank == 1 and epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)  # @killed-step


def stuck(dist, rank, world):
    dist.barrier()
    if rank == 1:
        _busy(float(os.environ.get("STUCK_FOR", "6")))  # a long computation  @busy
    dist.barrier()  # @stuck-barrier


def stuck_in_loop(dist, rank, world):
    """A training loop whose rank 1 computes for long in step 1: its call site is known
    by then, so on a torch engine rank 0's op is already in torch's hands."""
    t = np.ones(4, np.float32)
    for step in range(2):
        if rank == 1 and step == 1:
            _busy(float(os.environ.get("STUCK_FOR", "6")))  # a long computation  @busy-loop
        dist.all_reduce(t)  # @loop-step


def stuck_large(dist, rank, world):
    t = np.ones(_numel(), np.float32)
    dist.all_reduce(t)
    if rank == 1:
        _busy(float(os.environ.get("STUCK_FOR", "6")))
    dist.all_reduce(t)  # @stuck-large


def p2p_cycle(dist, rank, world):
    other = 1 - rank
    t = np.zeros(4, np.float32)
    dist.barrier()  # arrive together: the first capture of a call site reads source files
    dist.recv(t, src=other)  # both ranks receive first: nobody sends  @cycle-recv
    dist.send(t, dst=other)


def barrier_names(dist, rank, world):
    dist.barrier(name="after-load")
    dist.barrier(name="checkpoint" if rank == 0 else "epoch-end")  # @named


def zero_first_raises(dist, rank, world):
    with dist.rank_zero_first():  # @rzf-with
        if rank == 0:
            raise OSError("download failed: dataset server unreachable")  # @rzf-raise
    dist.barrier()


def zero_first_slow_ok(dist, rank, world):
    """Correct: rank 0's block takes longer than the collective timeout and the warning
    threshold, within the block's own timeout; nobody may time out or warn."""
    with dist.rank_zero_first(timeout=30):
        if rank == 0:
            time.sleep(float(os.environ.get("BLOCK_FOR", "2")))
    t = np.ones(4, np.float32)
    for _ in range(200):
        dist.all_reduce(t)
        t[:] = 1
    for _ in range(20):
        dist.barrier()
    with dist.main_process_first():
        pass
    dist.monitored_barrier(timeout=5)
    print("OK", flush=True)


def monitored(dist, rank, world):
    dist.barrier()
    if rank == 1:
        time.sleep(3)  # @late
    dist.monitored_barrier(timeout=1)  # @monitored


def traced(dist, rank, world):
    t = np.ones(8, np.float32)
    for _ in range(3):
        dist.all_reduce(t)  # @traced-step
    with dist.record_comm("sync point"):
        dist.barrier()
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)


CASES = {f.__name__: f for f in (subset_barrier, uneven_batches, shape, dtype, root, op,
                                   raises, exits_early, killed, stuck, stuck_in_loop, stuck_large, p2p_cycle,
                                   barrier_names, zero_first_raises, zero_first_slow_ok,
                                   monitored, traced)}


def main() -> None:
    import rankwise as dist

    case = CASES[sys.argv[1]]
    dist.init_process_group("gloo")
    case(dist, dist.get_rank(), dist.get_world_size())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
