"""torch's DDP on backend "rankwise", and rank 1 dies before backward: rank 0's backward
raises what torch's reducer made of rankwise's PeerFailure, which ``rankwise.unwrap``
gives back; rank 0 writes what it saw to OUT/seen.json, then lets it propagate.

    torch_ddp_peer_dies.py OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rankwise
import rankwise.torch  # registers backend "rankwise"


def main():
    dist.init_process_group("rankwise")
    rank = dist.get_rank()
    ddp = DDP(nn.Linear(4, 1))
    loss = ddp(torch.ones(2, 4)).sum()
    if rank == 1:
        os._exit(3)  # dies without a word
    try:
        loss.backward()
    except RuntimeError as exc:
        error = rankwise.unwrap(exc)
        seen = {"message": str(exc), "unwrapped": type(error).__name__,
                "peer": getattr(error, "rank", None),
                "caught": isinstance(error, rankwise.PeerFailure),
                "same": rankwise.unwrap(error) is error}
        Path(sys.argv[1], "seen.json").write_text(json.dumps(seen))
        raise


if __name__ == "__main__":
    main()
