"""torch 2.15's debug server in a plain torch job (backend "gloo", no rankwise import):
every rank starts it, rank 0's frontend answers; it writes what it got to OUT/got.json.

    torch_debug_server.py OUT PORT
"""

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch.distributed as dist
from torch.distributed.debug import start_debug_server, stop_debug_server


def fetch(url):
    """The frontend's page (it starts in a child process: asked again until it answers)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=60) as reply:  # noqa: S310 - http only
                return reply.status, reply.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:  # an answer: the page's own failure
            return exc.code, exc.read().decode(errors="replace")
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main():
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start_debug_server(port=port)  # a TCPStore client of MASTER_PORT, on every rank
    dist.barrier()
    if rank == 0:
        got = {"backend": str(dist.get_backend())}
        for page in ("", "stacks", "fr_trace"):
            status, body = fetch(f"http://127.0.0.1:{port}/{page}")
            got[page or "index"] = [status, body]
        (out / "got.json").write_text(json.dumps(got))
        stop_debug_server()  # torch's: on rank 0 only (elsewhere it raises AssertionError)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
