"""A plain torch gloo job (no rankwise) broken on purpose, leaving flight-recorder dumps.

``python _flight_recorder_program.py RANK PORT DIR``: 2 ranks; two all_reduces agree, then
rank 0 calls all_reduce while rank 1 calls broadcast (with another dtype); gloo times out
after 1 s and each rank writes the dump torch keeps, in both of torch's forms: the pickle
of ``_dump_fr_trace`` to ``DIR/pickle/nccl_trace_rank_<r>`` (torch's default file name) and
the JSON of ``_dump_fr_trace_json`` to ``DIR/json/nccl_trace_rank_<r>``.
"""

import datetime
import os
import sys

os.environ["TORCH_FR_BUFFER_SIZE"] = "64"

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# the 1 s timeout is for the broken collective: both ranks meet first under a long one
# (one may import torch seconds after the other on a loaded machine)
store = dist.TCPStore("127.0.0.1", int(port), 2, rank == 0,
                      timeout=datetime.timedelta(seconds=60))
store.set(f"up/{rank}", "1")
store.wait(["up/0", "up/1"])
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=1))
t = torch.ones(4)
for _ in range(2):
    dist.all_reduce(t)
try:
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(torch.ones(4, dtype=torch.float64), src=0)
except RuntimeError as exc:
    print(f"rank {rank}: {exc}", file=sys.stderr)
for form, data in (("pickle", _dump_fr_trace()), ("json", _dump_fr_trace_json())):
    os.makedirs(os.path.join(out, form), exist_ok=True)
    with open(os.path.join(out, form, f"nccl_trace_rank_{rank}"), "wb") as fh:
        fh.write(data)
os._exit(0)  # gloo's teardown after a timeout can block; the dumps are written
