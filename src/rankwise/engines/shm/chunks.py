"""Where a large (all_)reduce puts each chunk in the slots (offsets only; no I/O here).

The pipelined reduction (``ShmGroup._pipelined``) splits the buffer into chunks and each
chunk into one part per rank; rank j reduces part j. Round t publishes chunk t's input
and chunk t-1's reduced parts. Why a chunk fills a whole slot: a rank never copies its
*own* part in (it reduces it straight from its buffer), so that region of its slot is
free, and it is exactly where its reduced part goes (in the slot of the next parity,
beside the next chunk's input, which again leaves that region free). The earlier layout
kept a separate result area and fit n/(n+1) of a slot per chunk: a fifth more rounds at
4 ranks, a third more at 2.

Why every chunk uses the same part boundaries (the last one clipped): the free region
of a slot must be the same for the chunk whose input lands there and the chunk whose
result lands there. Why the per-rank skew: slots lie at a power-of-two stride, so equal
offsets put the n inputs of a part and its result in the same cache sets (4 ranks, 2 MiB
slots, 1 MiB: 0.7 ms with a skew, 2 ms without); rank r's chunk area starts ``r * SKEW``
bytes into its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALIGN", "SKEW", "ChunkPlan", "padding", "plan_chunks"]

ALIGN = 64  #: part boundaries, in bytes: whole cache lines
SKEW = 2048 + 64  #: half a page and a line between consecutive ranks' chunk areas
_PAD_UNIT = 65536  #: slots are sized in these


def padding(nranks: int) -> int:
    """Bytes a slot needs beyond its nominal size so that a message of the nominal size
    is still one chunk beside the skews (a 1 MiB all_reduce on 1 MiB slots: 2 rounds,
    not 3)."""
    return -(-(nranks - 1) * SKEW // _PAD_UNIT) * _PAD_UNIT


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Chunks of ``count`` elements: chunk t covers ``[start(t), start(t) + length(t))``;
    rank j's part of it is ``span(t, j)`` (element offsets within the chunk) and sits at
    byte ``base[r] + span(t, j)[0] * itemsize`` of rank r's slot (input for r != j,
    result for r == j)."""

    count: int
    per_chunk: int  #: elements in every chunk but the last
    bounds: tuple[tuple[int, int], ...]  #: each rank's part of a full chunk
    base: tuple[int, ...]  #: byte offset of each rank's chunk area in its slot

    @property
    def chunks(self) -> int:
        return -(-self.count // self.per_chunk)

    def start(self, t: int) -> int:
        return t * self.per_chunk

    def length(self, t: int) -> int:
        return min(self.per_chunk, self.count - t * self.per_chunk)

    def span(self, t: int, j: int) -> tuple[int, int]:
        m = self.length(t)
        lo, hi = self.bounds[j]
        return min(lo, m), min(hi, m)


def plan_chunks(count: int, itemsize: int, nranks: int, slot_bytes: int) -> ChunkPlan:
    """The fewest chunks that fit a slot, then equal ones (so no chunk is a sliver and
    every rank's part is about the same size); ``count`` must be positive."""
    quant = max(1, ALIGN // itemsize) * nranks  # a chunk splits into aligned equal parts
    skew = SKEW if 4 * (nranks - 1) * SKEW <= slot_bytes else 0  # many ranks, tiny slots
    room = (slot_bytes - (nranks - 1) * skew) // itemsize
    cap = max(quant, room // quant * quant)
    chunks = -(-count // cap)
    per_chunk = -(-count // chunks)
    per_chunk = -(-per_chunk // quant) * quant  # still <= cap: cap is a multiple of quant
    q = per_chunk // nranks
    return ChunkPlan(count, per_chunk, tuple((j * q, (j + 1) * q) for j in range(nranks)),
                     tuple(r * skew for r in range(nranks)))
