"""Group creation order: every rank must call ``new_group`` for every group, in one order.

Why: a group's id comes from how many groups a rank has created before it, so two ranks
that create the same groups in a different order give one group two ids. Nothing fails
then: their collectives wait for frames that never come, and after the timeout the
who-is-where table reports a false deadlock. torch has the same rule (and a store-based
barrier over the whole job in ``new_group``); here that round also carries what each
rank created — the member list and the call site — so the first ``new_group`` out of
order raises ``CollectiveMismatch`` on every rank, naming both calls, before any data
moves. The round replaces the members' host exchange the engine choice needs (the
entry carries the host identity too), so groups cost no round trip they did not have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CollectiveMismatch, DistTimeout
from ..identity.callsite import CallSite
from ..store.gather import gather
from ..store.seen import count_seen_and_hold
from .report import rank_list

__all__ = ["GroupEntry", "agree_on_group"]

_MAX_ENTRY = 64 * 1024  #: bytes of one rank's entry read back (the store is shared)


@dataclass(frozen=True)
class GroupEntry:
    """What one rank created as its ``index``-th group."""

    ranks: tuple[int, ...]
    site: CallSite
    host: str

    def encode(self) -> str:
        return json.dumps({"ranks": list(self.ranks), "site": self.site.encode(),
                           "host": self.host})

    @staticmethod
    def decode(raw: bytes) -> GroupEntry:
        """A peer's entry; anything malformed reads as an entry that matches nothing."""
        try:
            data = json.loads(raw[:_MAX_ENTRY].decode("utf-8", "replace"))
            ranks = tuple(int(r) for r in data["ranks"][:1 << 16])
            return GroupEntry(ranks, CallSite.decode(0, str(data.get("site", ""))),
                              str(data.get("host", ""))[:4096])
        except (ValueError, TypeError, KeyError, AttributeError):
            return GroupEntry((-1,), CallSite(0, ()), "")

    def call(self) -> str:
        where = f" at {self.site.chain}" if self.site.frames else ""
        return f"new_group({list(self.ranks)}){where}"


def agree_on_group(store: Any, index: int, mine: GroupEntry, rank: int, world_size: int,
                   timeout: float, hosting: bool = False) -> list[GroupEntry]:
    """Every rank's ``index``-th group (one store round over the job, O(N) requests: rank
    0 gathers and publishes a verdict), in rank order; ``CollectiveMismatch`` on every
    rank when they are not all the same group. ``hosting``: this process hosts the
    store, and keeps it up on a mismatch until every rank has read the entries that
    explain it."""
    prefix = f"new_group/{index}"
    try:
        blob = gather(store, prefix, mine.encode(), world_size, rank, timeout, _verdict)
    except DistTimeout:
        keys = [f"{prefix}/{r}" for r in range(world_size)]
        late = [r for r, k in enumerate(keys) if not store.check([k])]
        who = rank_list(late) if late else "some ranks"
        raise DistTimeout(
            f"new_group #{index} ({mine.call()}) on rank {rank}: {who} did not call "
            f"their new_group #{index} within {timeout:g}s. Every rank must "
            "call new_group for every group, members or not, in the same order (as in "
            "torch.distributed).") from None
    entries = _entries(blob, world_size)
    kinds: dict[tuple[int, ...], list[int]] = {}
    for r, e in enumerate(entries):
        kinds.setdefault(e.ranks, []).append(r)
    if len(kinds) > 1:
        count_seen_and_hold(store, f"{prefix}/seen", lambda: world_size, hosting)
        raise CollectiveMismatch(_mismatch_text(index, entries, kinds, rank))
    return entries


def _verdict(raw: list[bytes]) -> str:
    """What rank 0 publishes: when every rank created the same group, its members and
    each rank's host (all that members need); else every entry, for the report."""
    entries = [GroupEntry.decode(r) for r in raw]
    if len({e.ranks for e in entries}) == 1:
        return json.dumps({"ranks": list(entries[0].ranks), "hosts": [e.host for e in entries]})
    return json.dumps({"entries": [r[:_MAX_ENTRY].decode("utf-8", "replace") for r in raw]})


def _entries(blob: str, world_size: int) -> list[GroupEntry]:
    """Every rank's entry from rank 0's verdict (sites are kept only for a mismatch)."""
    broken = [GroupEntry((-1,), CallSite(0, ()), "")] * world_size
    try:
        data = json.loads(blob)
        if "entries" in data:
            entries = [GroupEntry.decode(str(e).encode()) for e in data["entries"]]
        else:
            ranks = tuple(int(r) for r in data["ranks"][:1 << 16])
            entries = [GroupEntry(ranks, CallSite(0, ()), str(h)[:4096])
                       for h in data["hosts"]]
    except (ValueError, TypeError, KeyError, AttributeError):
        return broken
    return entries if len(entries) == world_size else broken


def _mismatch_text(index: int, entries: list[GroupEntry],
                   kinds: dict[tuple[int, ...], list[int]], rank: int) -> str:
    sides = [f"{rank_list(ranks)} created {entries[ranks[0]].call()}"
             for ranks in sorted(kinds.values(), key=lambda rs: rs[0])]
    return (f"new_group order mismatch at group creation #{index}: " + "; but ".join(sides)
            + ". Every rank must call new_group for every group, members or not, in the "
            "same order (as in torch.distributed): create the groups in one loop that "
            "runs the same on every rank, e.g. `for ranks in [[0, 1], [2, 3]]: "
            f"g = new_group(ranks)`, and keep the one this rank belongs to. (raised on "
            f"rank {rank}, before any data moved)")
