"""One rank of a crowded tcp job (more ranks than CPUs): small all_reduces and barriers
take the tree, and the calls read their own frames. Each rank proves the barrier held
it until every rank arrived (a file per rank written before it), and sums correctly."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import rankwise as dist
from rankwise.api.world import current

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
crowded = bool(getattr(current().comm.transport, "crowded", False))
sums, complete = [], []
for step in range(3):
    with open(os.path.join(out, f"arrived_{step}_{rank}"), "w"):
        pass
    dist.barrier()
    complete.append(len([n for n in os.listdir(out) if n.startswith(f"arrived_{step}_")]))
    t = np.full(1, rank + step, dtype=np.float32)
    dist.all_reduce(t)
    sums.append(float(t[0]))
with open(os.path.join(out, f"result_{rank}.json"), "w") as f:
    json.dump({"crowded": crowded, "world": world, "sums": sums, "complete": complete}, f)
dist.destroy_process_group()
