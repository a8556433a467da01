"""Binomial trees: broadcast and reduce in ceil(log2 n) rounds (latency-bound sizes).

Ranks are renumbered relative to the root (``v = (rank - root) % n``) so any root works
and any group size, power of two or not.
"""

from __future__ import annotations

import numpy as np

from .link import Array, Link, recv

__all__ = ["broadcast", "reduce"]


def broadcast(link: Link, data: Array, root: int) -> None:
    n, v = link.size, (link.rank - root) % link.size
    mask = 1
    while mask < n:
        if v & mask:
            recv(link, (v - mask + root) % n, data, 0)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            link.send((v + mask + root) % n, data, 0)
        mask >>= 1


def reduce(link: Link, data: Array, root: int) -> None:
    """Reduce into ``data`` on the root; other ranks' ``data`` is left unchanged."""
    n, v = link.size, (link.rank - root) % link.size
    acc = data if v == 0 else None
    tmp = None
    mask = 1
    while mask < n:
        if v & mask:
            link.send((v - mask + root) % n, data if acc is None else acc, 0)
            break
        if v + mask < n:
            if acc is None:
                acc = data.copy()
            if tmp is None:
                tmp = np.empty_like(data)
            recv(link, (v + mask + root) % n, tmp, 0)
            link.reduce(acc, tmp)
        mask <<= 1
    if v == 0:
        link.finish_avg(data)
