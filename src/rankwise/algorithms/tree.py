"""Binomial trees: broadcast and reduce in ceil(log2 n) rounds.

Ranks are renumbered relative to the root (``v = (rank - root) % n``) so any root works
and any group size, power of two or not. Large broadcasts are cut into segments that
each rank forwards to its children as soon as it has them, so the tree works as a
pipeline instead of moving the whole message one level at a time. Large reduces go
through a ring reduce-scatter plus a gather to the root (see ``reduce``).
"""

from __future__ import annotations

import numpy as np

from . import ring
from .agree import Agreement, others
from .link import Array, Lane, Link, recv

__all__ = ["all_reduce", "barrier", "broadcast", "reduce"]


def _parent_children(v: int, n: int) -> tuple[int, list[int]]:
    """The virtual parent (-1 for the root) and children, largest subtree first."""
    parent, mask = -1, 1
    while mask < n:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            children.append(v + mask)
        mask >>= 1
    return parent, children


#: A tree is a pipeline only if the message is cut into pieces: uncut, each level waits
#: for the whole message (store and forward, depth x the time of one hop). The rings'
#: 4 MiB segments would leave a 4 MiB broadcast uncut, so trees keep gloo's 1 MiB. (On one
#: 2-core machine a same-run A/B of 1, 2 and 4 MiB pieces showed no difference beyond
#: noise; the pipeline matters where hops are real network links.)
PIPELINE_BYTES = 1 << 20


def broadcast(link: Link, data: Array, root: int) -> None:
    n = link.size
    v = (link.rank - root) % n
    parent, children = _parent_children(v, n)
    segs = ring.segments(data, PIPELINE_BYTES)
    real = [(c + root) % n for c in children]
    fed_by_root = [(c + root) % n for c in _parent_children(0, n)[1]]
    agreement = Agreement(link, root, others(n, root, fed_by_root), others(n, root))
    if parent < 0:
        for k, seg in enumerate(segs):
            for child in real:
                link.send(child, seg, k)
        agreement.finish()
        return
    src = (parent + root) % n
    handles = [link.post(src, seg, k) for k, seg in enumerate(segs)]
    for k, (seg, h) in enumerate(zip(segs, handles)):
        link.wait(h)
        for child in real:
            link.send(child, seg, k)
    agreement.finish()


#: reduces of at least this many bytes use reduce-scatter + gather (bandwidth-optimal)
LARGE_REDUCE = 1 << 20


def reduce(link: Link, data: Array, root: int) -> None:
    """Reduce into ``data`` on the root; other ranks' ``data`` is left unchanged."""
    n, v = link.size, (link.rank - root) % link.size
    if n > 2 and data.nbytes >= LARGE_REDUCE and data.size >= n:
        agreement = Agreement(link, root, others(n, root), ())  # all send to the root
        _reduce_large(link, data, root)
        agreement.finish()
        return
    feeds_root = [(m + root) % n for m in _powers_below(n)]
    agreement = Agreement(link, root, others(n, root), others(n, root, feeds_root))
    acc = data if v == 0 else None
    room = ring.scratch(2 * data.nbytes)  # reused across calls: no page faults
    tmp = room[:data.nbytes].view(data.dtype)
    mask = 1
    while mask < n:
        if v & mask:
            link.send((v - mask + root) % n, data if acc is None else acc, 0)
            break
        if v + mask < n:
            if acc is None:
                acc = room[data.nbytes:2 * data.nbytes].view(data.dtype)
                acc[...] = data
            recv(link, (v + mask + root) % n, tmp, 0)
            link.reduce(acc, tmp)
        mask <<= 1
    if v == 0:
        link.finish_avg(data)
    agreement.finish()


def _powers_below(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``: the virtual ranks that send straight to the root."""
    out, m = [], 1
    while m < n:
        out.append(m)
        m <<= 1
    return out


def _reduce_large(link: Link, data: Array, root: int) -> None:
    """Ring reduce-scatter on a copy, then every rank sends its reduced chunk to the
    root: each rank moves ~2x the message instead of the tree's log2(n) x."""
    work = data if link.rank == root else data.copy()
    chunks = [work[a:b] for a, b in ring.chunk_bounds(work.size, link.size)]
    ring.reduce_scatter(link, chunks)  # chunk r of rank r is final (AVG divided)
    if link.rank != root:
        link.send(root, chunks[link.rank], 0, Lane.GATHER)
        return
    handles = [link.post(r, chunks[r], 0, Lane.GATHER) for r in range(link.size) if r != root]
    for h in handles:
        link.wait(h)


def all_reduce(link: Link, data: Array) -> None:
    """Reduce up a binomial tree to rank 0, then broadcast down it: 2 log2 n hops against
    recursive doubling's log2 n, but each rank is woken about twice a call instead of
    log2 n times, which is what counts when ranks outnumber CPUs (docs/scale.md). Every
    rank gets rank 0's bits; every rank sends a frame a peer checks, and receives one."""
    n, v = link.size, link.rank
    if n == 1:
        link.finish_avg(data)
        return
    parent, children = _parent_children(v, n)
    tmp = np.empty_like(data)
    for child in reversed(children):  # smallest subtree first: it is ready first
        recv(link, child, tmp, 0)
        link.reduce(data, tmp)
    if parent < 0:
        link.finish_avg(data)
    else:
        link.send(parent, data, 0)
        recv(link, parent, data, 1)
    for child in children:
        link.send(child, data, 1)


_EMPTY = np.empty(0, dtype=np.uint8)


def barrier(link: Link) -> None:
    """Arrivals up a binomial tree to rank 0, the release back down: for ranks that
    outnumber CPUs, as ``all_reduce`` (each rank woken about twice, where the
    dissemination barrier wakes it log2 n times)."""
    n, v = link.size, link.rank
    if n == 1:
        return
    parent, children = _parent_children(v, n)
    arrivals = [link.post(child, np.empty(0, dtype=np.uint8), 0) for child in children]
    for handle in reversed(arrivals):  # smallest subtree first: it is ready first
        link.wait(handle)
    if parent >= 0:
        release = link.post(parent, np.empty(0, dtype=np.uint8), 1)
        link.send(parent, _EMPTY, 0)
        link.wait(release)
    for child in children:
        link.send(child, _EMPTY, 1)
