"""Recursive doubling all-reduce and a dissemination barrier: log2(n) rounds, for small
messages where latency, not bandwidth, decides.

Non-powers of two: the first 2*rem ranks pair up and the even one of each pair folds
its data into the odd one and sits out; the remaining power of two run the doubling;
the sitters get the result back at the end. Every rank computes each pairwise sum in
the same order (a+b and b+a are the same IEEE value), so results are bit-identical.
"""

from __future__ import annotations

import numpy as np

from .link import Array, Link, recv

__all__ = ["all_reduce", "barrier"]

_FOLD, _UNFOLD = 0, 63


def all_reduce(link: Link, data: Array) -> None:
    n, r = link.size, link.rank
    if n == 1:
        link.finish_avg(data)
        return
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    tmp = np.empty_like(data)
    if r < 2 * rem:
        if r % 2 == 0:
            link.send(r + 1, data, _FOLD)
            recv(link, r + 1, data, _UNFOLD)
            return
        recv(link, r - 1, tmp, _FOLD)
        link.reduce(data, tmp)
        v = r // 2
    else:
        v = r - rem

    def real(vr: int) -> int:
        return vr * 2 + 1 if vr < rem else vr + rem

    mask, step = 1, 1
    while mask < p:
        peer = real(v ^ mask)
        h = link.post(peer, tmp, step)
        link.send(peer, data, step)
        link.wait(h)
        link.reduce(data, tmp)
        mask <<= 1
        step += 1
    link.finish_avg(data)
    if r < 2 * rem:
        link.send(r - 1, data, _UNFOLD)


_EMPTY = np.empty(0, dtype=np.uint8)


def barrier(link: Link) -> None:
    """Dissemination barrier: in round k, signal rank+2^k and wait for rank-2^k."""
    n, r = link.size, link.rank
    dist, step = 1, 0
    while dist < n:
        h = link.post((r - dist) % n, np.empty(0, dtype=np.uint8), step)
        link.send((r + dist) % n, _EMPTY, step)
        link.wait(h)
        dist <<= 1
        step += 1
