"""torch's DDP on backend "rankwise", and a failure inside it: rank 0 (and, for a
mismatch, rank 1) raises what torch made of rankwise's error, which ``rankwise.unwrap``
gives back; each rank that raised writes what it saw to OUT/seen<rank>.json, then lets it
propagate.

    torch_ddp_peer_dies.py OUT [MODE]

MODE ``backward`` (the default): rank 1 dies before backward (the reducer's bucket
future); ``hook``: the same under a Python comm hook (the error is raised in the hook's
``then``); ``construct``: rank 1 dies before ``DDP(...)`` (its parameter check, a
collective torch's C++ calls); ``broadcast``: rank 1 dies inside ``DDP(...)`` right after
that check, so rank 0 fails in ``_broadcast_coalesced`` of the parameters; ``mismatch``: rank 1 makes an all_reduce of its own before
backward.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel import distributed as ddp_module

import rankwise
import rankwise.torch  # registers backend "rankwise"


def main():
    mode = sys.argv[2] if len(sys.argv) > 2 else "backward"
    dist.init_process_group("rankwise")
    rank = dist.get_rank()
    dies = rank == 1 and mode != "mismatch"
    try:
        if dies and mode == "construct":
            os._exit(3)  # dies without a word
        if dies and mode == "broadcast":
            check = ddp_module._verify_param_shape_across_processes

            def check_then_die(*args, **kwargs):
                check(*args, **kwargs)
                os._exit(3)

            ddp_module._verify_param_shape_across_processes = check_then_die
        ddp = DDP(nn.Linear(4, 1))
        if mode == "hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        loss = ddp(torch.ones(2, 4)).sum()
        if dies:
            os._exit(3)
        if rank == 1:
            dist.all_reduce(torch.ones(3))  # rank 0 reduces its gradient bucket instead
        loss.backward()
    except RuntimeError as exc:
        error = rankwise.unwrap(exc)
        seen = {"message": str(exc), "unwrapped": type(error).__name__,
                "printed": "".join(traceback.format_exception(exc)),
                "peer": getattr(error, "rank", None),
                "caught": isinstance(error, (rankwise.PeerFailure,
                                             rankwise.CollectiveMismatch)),
                "same": rankwise.unwrap(error) is error}
        Path(sys.argv[1], f"seen{rank}.json").write_text(json.dumps(seen))
        raise


if __name__ == "__main__":
    main()
