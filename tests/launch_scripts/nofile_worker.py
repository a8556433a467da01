"""A rank (``NOFILE_RANK``) that starts init with all but ``NOFILE_SPARE`` of 64 file
descriptors taken (``ulimit -n 64``); every rank prints what init raised, if anything."""

from __future__ import annotations

import os
import resource

RANK = int(os.environ["RANK"])


def take_descriptors(limit: int, spare: int) -> list[int]:
    """Lower RLIMIT_NOFILE to ``limit`` and hold open all descriptors but ``spare``."""
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(spare):
        os.close(held.pop())
    return held


def main() -> None:
    import rankwise as dist

    if RANK == int(os.environ.get("NOFILE_RANK", "1")):
        take_descriptors(64, int(os.environ.get("NOFILE_SPARE", "2")))
    try:
        dist.init_process_group("tcp", timeout=float(os.environ.get("NOFILE_TIMEOUT", "1800")))
    except Exception as exc:
        print(f"raised {RANK} {type(exc).__name__}: {exc}", flush=True)
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
