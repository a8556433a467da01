"""Uses the core: rank 1 raises between two all_reduces; the others must get PeerFailure."""

from __future__ import annotations

import os
import sys

import numpy as np

import rankwise

out = sys.argv[1]
rankwise.init_process_group(backend="tcp", init_method="env://")
rank = rankwise.get_rank()
try:
    buf = np.ones(4)
    rankwise.all_reduce(buf)
    if rank == 1:
        raise ValueError("rank 1 gives up")
    rankwise.all_reduce(buf)
except rankwise.PeerFailure as exc:
    with open(os.path.join(out, f"peer_failure_{rank}"), "w") as fh:
        fh.write(str(exc.rank))
    raise
finally:
    with open(os.path.join(out, f"finally_{rank}"), "w") as fh:
        fh.write("1")
