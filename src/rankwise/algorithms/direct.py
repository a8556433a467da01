"""Direct schedules: every rank talks to the ranks it needs, all receives posted first.

Used for gather, scatter and all-to-all, where each message has exactly one source and
one destination and nothing can be combined on the way.
"""

from __future__ import annotations

from .agree import Agreement, others
from .link import Array, Handle, Link

__all__ = ["all_to_all", "gather", "scatter"]


def gather(link: Link, mine: Array, slots: list[Array] | None, root: int) -> None:
    """Root fills ``slots[i]`` with rank i's ``mine``; others only send (and wait for the
    root's word that every rank agreed, see ``agree``)."""
    agreement = Agreement(link, root, others(link.size, root), ())
    if link.rank != root:
        link.send(root, mine, 0)
        agreement.finish()
        return
    assert slots is not None
    handles = [link.post(i, slots[i], 0) for i in range(link.size) if i != root]
    slots[root][...] = mine
    for h in handles:
        link.wait(h)
    agreement.finish()


def scatter(link: Link, out: Array, slots: list[Array] | None, root: int) -> None:
    """Rank i's ``out`` receives root's ``slots[i]``."""
    agreement = Agreement(link, root, (), others(link.size, root))
    if link.rank != root:
        link.wait(link.post(root, out, 0))
        agreement.finish()
        return
    assert slots is not None
    for k in range(1, link.size):
        i = (root + k) % link.size
        link.send(i, slots[i], 0)
    out[...] = slots[root]
    agreement.finish()


def all_to_all(link: Link, outs: list[Array], ins: list[Array]) -> None:
    """``outs[j]`` on rank i receives ``ins[i]`` of rank j."""
    n, r = link.size, link.rank
    handles: list[Handle] = [link.post((r - k) % n, outs[(r - k) % n], 0) for k in range(1, n)]
    for k in range(1, n):
        j = (r + k) % n
        link.send(j, ins[j], 0)
    outs[r][...] = ins[r]
    for h in handles:
        link.wait(h)
