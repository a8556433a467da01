"""Root agreement: no rank returns from a rooted collective until every rank agreed.

Why: in broadcast and scatter the root only sends, in reduce and gather it only
receives. A rank that wrongly believes it is the root (``broadcast(t, src=rank)``) then
never meets a frame that contradicts its call, returns, and leaves the ranks holding
different data. Fingerprints ride in every frame header, so agreement needs no payload,
only that the right empty frames cross:

- **hello** (root -> each rank it sends no data to): a rank that believes in another
  root, or is a root itself, finds the contradiction in the hello's header;
- **ack** (each rank that sends no data to the root -> root), sent on entry: the root
  compares every rank's fingerprint with its own before it returns;
- **release** (root -> every rank, after all acks and data arrived and matched): a
  non-root returns only once the root has seen that every rank agreed.

Between them a frame crosses every disagreement: if ranks x and y disagree, either x
sends to its root r (ack or data) and r differs from x, or r agrees with x and
sends to y (hello or data), which differs from r. A mismatch found anywhere poisons
that rank and reaches every other one as an abort while all of them still wait in the
call, so every rank raises ``CollectiveMismatch`` from that very call. Cost: one extra
message latency for the non-roots (the release; the ack travels while the data does),
one round trip for the root; empty frames only. With two ranks the release is left
out: the non-root has then itself compared the only other rank's call (a hello or data
frame from the root), so agreement is already known on both sides.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .link import Handle, Link

__all__ = ["ACK", "HELLO", "RELEASE", "Agreement"]

#: step numbers of the agreement frames, above every step an algorithm uses
HELLO, ACK, RELEASE = 0xFFFF_FFF0, 0xFFFF_FFF1, 0xFFFF_FFF2
_NOTHING = np.empty(0, np.uint8)


class Agreement:
    """One rooted call's agreement. ``hello_to``: the ranks the root sends no data to
    directly; ``ack_from``: the ranks that send no data to the root directly (both as
    group ranks, the same on every rank that agrees on the root). Make it on entry,
    before the algorithm moves data; call ``finish`` after it."""

    __slots__ = ("_acks", "_hello", "_link", "_release", "_root")

    def __init__(self, link: Link, root: int, hello_to: Collection[int],
                 ack_from: Collection[int]) -> None:
        self._link, self._root = link, root
        self._acks: list[Handle] = []
        self._hello: Handle | None = None
        self._release: Handle | None = None
        me = link.rank
        if me == root:
            for peer in hello_to:
                link.send(peer, _NOTHING, HELLO)
            self._acks = [link.post(peer, np.empty(0, np.uint8), ACK) for peer in ack_from]
            return
        if me in hello_to:
            self._hello = link.post(root, np.empty(0, np.uint8), HELLO)
        if link.size > 2:
            self._release = link.post(root, np.empty(0, np.uint8), RELEASE)
        if me in ack_from:
            link.send(root, _NOTHING, ACK)

    def finish(self) -> None:
        link = self._link
        if link.rank == self._root:
            for h in self._acks:
                link.wait(h)
            if link.size > 2:
                for peer in range(link.size):
                    if peer != self._root:
                        link.send(peer, _NOTHING, RELEASE)
            return
        if self._hello is not None:
            link.wait(self._hello)
        if self._release is not None:
            link.wait(self._release)


def others(n: int, root: int, but: Collection[int] = ()) -> list[int]:
    """Every group rank except ``root`` and ``but``."""
    skip = set(but)
    return [r for r in range(n) if r != root and r not in skip]
