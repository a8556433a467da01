"""Agreeing on all_to_all's split sizes before a foreign engine moves the data.

Why: an all_to_all's sizes vary by pair, so its fingerprint carries no count and the
ring check cannot see a rank that sends 2 rows where its peer expects 1. rankwise's own
engines find that in the frames; gloo terminates the process (``EnforceNotMet``, when
more bytes arrive than it expects). So before the data moves, every rank all-gathers its
row of the size table (bytes it sends to and expects from each rank) and its call site,
in fixed-size parts that no mismatch can make unequal. Every rank then finds the same
first disagreement and raises the same ``CollectiveMismatch`` naming both calls.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...identity.calls import describe
from ...identity.callsite import CallSite
from ..base import Array, Call, CallsDisagree

__all__ = ["SITE_BYTES", "check_splits"]

#: room for a call site's text in the size table (longer texts are cut)
SITE_BYTES = 1024

#: an all-gather of equal-sized uint8 rows: (this rank's row, everyone's rows)
Gather = Callable[[Array, list[Array]], None]


def check_splits(call: Call, sends: list[int], expects: list[int], gather: Gather) -> None:
    """Raise ``CallsDisagree`` (on every rank) if some rank sends a number of bytes
    that its receiver does not expect; ``gather`` all-gathers one fixed-size row."""
    n = call.size
    head = 16 * n + 8
    row = np.zeros(head + SITE_BYTES, np.uint8)
    numbers = row[:head].view(np.int64)
    numbers[:n] = sends
    numbers[n:2 * n] = expects
    numbers[2 * n] = call.site.id & 0x7FFFFFFFFFFFFFFF
    text = call.site.encode().encode("utf-8", "replace")[:SITE_BYTES]
    row[head:head + len(text)] = np.frombuffer(text, np.uint8)
    rows = [np.empty_like(row) for _ in range(n)]
    gather(row, rows)
    table = [r[:head].view(np.int64) for r in rows]
    for src in range(n):
        for dst in range(n):
            sent, expected = int(table[src][dst]), int(table[dst][n + src])
            if sent != expected:
                raise _mismatch(call, rows, head, src, dst, sent, expected)


def _mismatch(call: Call, rows: list[Array], head: int, src: int, dst: int, sent: int,
              expected: int) -> CallsDisagree:
    ranks = call.group.ranks

    def side(r: int) -> str:
        site_id = int(rows[r][:head].view(np.int64)[2 * call.size])
        text = bytes(rows[r][head:]).rstrip(b"\0").decode("utf-8", "replace")
        return describe(call.fp, CallSite.decode(site_id, text))

    return CallsDisagree(f"rank {ranks[src]} sends {sent} bytes to rank {ranks[dst]}, which "
                         f"expects {expected} bytes (uneven split sizes?)",
                         first=(ranks[src], side(src)), peer=ranks[dst],
                         theirs=lambda shape: side(dst), fail_group=True)
