"""A worker for `rankwise run` with connections opened on demand (RANKWISE_CONNECT=lazy).

LAZY_MODE  pairs: ranks 0 and 1 exchange a message, nobody else talks; each rank records
               the peers it holds a connection with
           early_death: rank 2 exits (code 3) right after init, before anyone connected
               to it; the others wait to receive from it and record what they raised
LAZY_OUT   a directory: each rank writes result_<rank>.json there
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import numpy as np

import rankwise as dist
from rankwise.api.world import maybe_current


def record(data: dict[str, Any]) -> None:
    path = os.path.join(os.environ["LAZY_OUT"], f"result_{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def connected() -> list[int]:
    world = maybe_current()
    assert world is not None
    return sorted(world.comm.transport.connected())  # type: ignore[attr-defined]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, mode = dist.get_rank(), os.environ["LAZY_MODE"]
    t = np.zeros(4, np.float32)
    if mode == "pairs":
        if rank in (0, 1):
            dist.send(t + rank, dst=1 - rank)
            dist.recv(t, src=1 - rank)
        record({"connected": connected(), "got": float(t[0])})
        # no rank leaves (closing its connections) before every rank has recorded its own
        dist.barrier()
    elif rank == 2:
        os._exit(3)
    else:
        try:
            dist.recv(t, src=2)
            record({"raised": None})
        except Exception as exc:
            record({"raised": type(exc).__name__, "rank": getattr(exc, "rank", None),
                    "message": str(exc)[:2000]})
            raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
