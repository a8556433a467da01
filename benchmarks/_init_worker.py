"""Times ``init_process_group`` plus a first barrier, on rankwise or torch gloo (argv[1])."""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    impl = sys.argv[1]
    if impl == "gloo":
        import torch.distributed as dist
    else:
        import rankwise as dist  # type: ignore[no-redef]
    start = time.monotonic()
    dist.init_process_group("gloo" if impl == "gloo" else "tcp")
    dist.barrier()
    print(f"init {impl} {os.environ['RANK']} {time.monotonic() - start:.3f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
