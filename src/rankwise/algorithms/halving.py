"""Rabenseifner all-reduce: recursive-halving reduce-scatter, recursive-doubling all-gather.

Why next to the ring: both move the same bytes per rank (2(n-1)/n of the message), but
this takes 2*log2(n) dependent hops instead of 2(n-1). When ranks outnumber cores every
hop also waits for the scheduler, so fewer hops matter (4 ranks: 4 hops, not 6).
Power-of-two groups only; the ring serves the rest.

Reduce-scatter: at distance n/2, n/4, ..., 1 each rank keeps one half of its current
range, sends the other half to its partner and reduces the partner's copy of its own
half into place. Afterwards each rank owns one fully reduced range (each element is
summed in exactly one place, so results are bit-identical on all ranks). All-gather
retraces the steps, exchanging whole ranges. Every receive is posted before the first
send, and for large messages partners exchange a clear-to-send first, so no payload is
parked and copied.
"""

from __future__ import annotations

import numpy as np

from .link import Array, Handle, Link
from .ring import CTS_BYTES, scratch, segments

__all__ = ["all_reduce", "usable"]

_STRIDE = 1 << 16  #: step ids: phase * _STRIDE + segment
_CTS = 0x7FFFFFFE
_EMPTY = np.empty(0, np.uint8)


def usable(n: int) -> bool:
    return n >= 2 and n & (n - 1) == 0


def _plan(rank: int, n: int, count: int) -> list[tuple[int, int, int, int, int]]:
    """Per halving step: (partner, keep_lo, keep_hi, send_lo, send_hi), element indices."""
    lo, hi = 0, count
    steps = []
    mask = n >> 1
    while mask:
        mid = lo + (hi - lo) // 2
        if rank & mask:
            steps.append((rank ^ mask, mid, hi, lo, mid))
            lo = mid
        else:
            steps.append((rank ^ mask, lo, mid, mid, hi))
            hi = mid
        mask >>= 1
    return steps


def all_reduce(link: Link, data: Array) -> None:
    n, r = link.size, link.rank
    plan = _plan(r, n, data.size)
    need = sum((khi - klo) * data.itemsize for _, klo, khi, _, _ in plan)
    arena = scratch(need)
    offset = 0
    # post everything: reduce-scatter temporaries, then all-gather targets (in place)
    rs: list[list[tuple[Handle, Array, Array]]] = []
    for i, (peer, klo, khi, _, _) in enumerate(plan):
        mine = data[klo:khi]
        tmp = arena[offset:offset + mine.nbytes].view(data.dtype)
        offset += mine.nbytes
        rs.append([(link.post(peer, t, i * _STRIDE + k), t, m)
                   for k, (t, m) in enumerate(zip(segments(tmp), segments(mine)))])
    ag: list[list[Handle]] = []
    for j, (peer, _, _, slo, shi) in enumerate(reversed(plan)):
        phase = len(plan) + j
        ag.append([link.post(peer, seg, phase * _STRIDE + k)
                   for k, seg in enumerate(segments(data[slo:shi]))])
    if data.nbytes // 2 >= CTS_BYTES:  # the first exchange would otherwise get parked
        ready = [link.post(peer, np.empty(0, np.uint8), _CTS) for peer, *_ in plan]
        for peer, *_ in plan:
            link.send(peer, _EMPTY, _CTS)
        for h in ready:
            link.wait(h)
    for i, (peer, _klo, _khi, slo, shi) in enumerate(plan):
        for k, seg in enumerate(segments(data[slo:shi])):
            link.send(peer, seg, i * _STRIDE + k)
        for handle, tmp_seg, mine_seg in rs[i]:
            link.wait(handle)
            link.reduce(mine_seg, tmp_seg)
    _, klo, khi, _, _ = plan[-1]
    link.finish_avg(data[klo:khi])
    for j, (peer, klo, khi, _, _) in enumerate(reversed(plan)):
        phase = len(plan) + j
        for k, seg in enumerate(segments(data[klo:khi])):
            link.send(peer, seg, phase * _STRIDE + k)
        for handle in ag[j]:
            link.wait(handle)
