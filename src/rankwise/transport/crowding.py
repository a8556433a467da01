"""Whether some host runs more of the job's ranks than it gives them CPUs ("crowded").

Why the job must know: with a CPU per rank, recursive doubling's log2 n hops are the
fastest small all_reduce; with ranks waiting for a CPU, what costs is how often each rank
is woken, and a tree reduce + broadcast wakes each rank about twice a call instead of
log2 n times (64 ranks on 2 cores, docs/scale.md). An algorithm must be the same on every
rank, so the figure rides in the address blob every rank of a tcp job reads
(handed out by the rendezvous, else ``mesh/addrs``): each rank's entry is ``host:port
cpus``, and every rank computes the same verdict from the same blob.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["crowded", "entry", "parse"]


def _cpus_here() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def entry(host: str, port: int) -> str:
    """This rank's line of the address blob."""
    return f"{host}:{port} {_cpus_here()}"


def parse(line: str) -> tuple[str, int]:
    """``(host:port, cpus)`` from a line of the blob (cpus 0 when a line has none)."""
    addr, _, cpus = line.partition(" ")
    return addr, int(cpus) if cpus.isdigit() else 0


def crowded(lines: Sequence[str]) -> bool:
    """True when the ranks at one address outnumber the most CPUs any of them has there.
    Ranks of one host that bind different addresses count apart: the verdict can miss a
    crowd (then doubling, as before), never invent one."""
    ranks: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for line in lines:
        addr, n = parse(line)
        host = addr.rpartition(":")[0]
        ranks[host] = ranks.get(host, 0) + 1
        cpus[host] = max(cpus.get(host, 0), n)
    return any(cpus[h] > 0 and ranks[h] > cpus[h] for h in ranks)
