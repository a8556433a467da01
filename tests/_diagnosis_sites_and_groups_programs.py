"""Programs for ``test_diagnosis_sites_and_groups.py`` (issue 15): a busy rank, groups created out
of order, tensor shapes in messages, a DDP gradient all_reduce's call site.

Run as ``python tests/_diagnosis_sites_and_groups_programs.py CASE`` in one process per rank, like
``test_diagnosis_programs.py`` (whose ``main`` and ``line_of`` this reuses); lines the
tests assert on carry an ``# @marker`` comment.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_diagnosis_programs as base


def load_data() -> None:
    time.sleep(float(os.environ.get("SLEEP_FOR", "6")))  # a stuck data loader  @sleep


def busy_sleep(dist, rank, world):
    """Rank 1 sleeps outside rankwise; rank 0 asks where it is (until the answer shows
    the sleep: the poll is bounded), prints the table, then waits in a barrier long
    enough for the slow-wait table (RANKWISE_WARN_AFTER) to be logged too."""
    dist.barrier()
    if rank == 1:
        load_data()  # @load-call
    else:
        deadline = time.monotonic() + 30
        table = ""
        while time.monotonic() < deadline and "(time.sleep)" not in table:
            table = dist.who_is_where()  # @ask
            threading.Event().wait(0.05)
        print(table, flush=True)
    dist.barrier()  # @busy-barrier


def group_order(dist, rank, world):
    """Ranks 0 and 2 create [0, 1] first, ranks 1 and 3 [2, 3] first (ORDER=same: all
    the same order, a correct program)."""
    if rank in (0, 2) or os.environ.get("ORDER") == "same":
        a = dist.new_group([0, 1])  # @order-a
        b = dist.new_group([2, 3])
    else:
        b = dist.new_group([2, 3])  # @order-b
        a = dist.new_group([0, 1])
    mine = a if rank < 2 else b
    t = np.ones(4, np.float32)
    dist.all_reduce(t, group=mine)  # @order-use
    assert t[0] == 2, t
    print("OK", flush=True)


def shapes(dist, rank, world):
    """Shapes differ but element counts agree (fine), then the counts differ too."""
    t = np.ones((2, 2) if rank == 0 else (4,), np.float32)
    dist.all_reduce(t)  # @same-count
    t = np.ones((2, 2) if rank == 0 else (1, 5), np.float32)
    dist.all_reduce(t)  # @shape-mismatch


def ddp_site(dist, rank, world):
    """Rank 0's gradient all_reduce (from loss.backward()) meets a plain all_reduce."""
    import torch

    from rankwise.nn import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    loss = model(torch.ones(2, 4)).sum()
    if rank == 0:
        loss.backward()  # @ddp-backward
    else:
        dist.all_reduce(np.ones(3, np.float32))  # @ddp-other


CASES = {f.__name__: f for f in (busy_sleep, group_order, shapes, ddp_site)}

if __name__ == "__main__":
    base.CASES = CASES
    base.main()
