"""Who the others wait for: straggler attribution, clock-free (docs/stragglers.md).

Why clock-free: every rank already knows how long it waited in each of its calls (the
call's ``started`` and ``finished``, kept in the group's history for who-is-where), and
the rank that arrives last is the one that waits least. Comparing waits of the same call
(by sequence number) needs no clock agreement between hosts.

What it costs a call: nothing. The waits are read from the history the group keeps
anyway, when someone asks (the live page's snapshot, ``rankwise.stragglers()``). What a
rank runs between calls is learned by a low-rate look at its user thread's stack
(``SAMPLE_PERIOD``), taken on this module's own thread only while the rank is in its own
code; each look is one ``sys._current_frames`` and a frame walk, ~10 per second.

``StragglerBook`` adds nothing to a call's path (it is no observer on the group's tuple):
the history the path already keeps holds each call's ``started`` and ``finished``.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import settings
from ..identity.callsite import stack_of
from ..identity.stacks import current_frames

__all__ = ["MIN_CALLS", "MIN_FRACTION", "MIN_MS", "MIN_SHARE", "Straggler", "StragglerBook",
           "attribute", "book_of", "enabled", "stragglers"]

SAMPLE_PERIOD = 0.1  #: seconds between two looks at the user thread's stack
SAMPLES = 200  #: looks kept (the last ~20 s of the rank's own code)
WINDOW = 64  #: calls per group compared (the group's history keeps 64)
LINES = 8  #: a rank's most seen lines it publishes
#: the thresholds (docs/stragglers.md, "Quiet when balanced"): at least MIN_CALLS calls
#: seen by every member, the same rank arriving last in at least MIN_SHARE of them (a
#: loaded machine delays ranks at random: by chance one of n ranks is last in 1/n of
#: them), and the wait it causes at least MIN_MS a step and MIN_FRACTION of the others'
MIN_CALLS = 16
MIN_SHARE = 0.75
MIN_MS = 5.0
MIN_FRACTION = 0.10


def enabled() -> bool:
    """``RANKWISE_STRAGGLERS=0`` turns the stack looks (and the attribution) off."""
    return settings.flag("RANKWISE_STRAGGLERS")


@dataclass(frozen=True)
class Straggler:
    """One rank that holds a group's other members back."""

    rank: int  #: global rank
    group: str
    per_call_ms: float  #: median of the wait it causes the others, per call
    per_step_ms: float  #: the wait it causes in all, per step (a repeating call)
    share: float  #: of the others' time, spent waiting for it
    line: str  #: where its own code spends the difference ("" when no look saw it)
    calls: int  #: calls compared
    steps: int

    def __str__(self) -> str:
        where = f" in {self.line}" if self.line else " (no look at its stack yet)"
        return (f"rank {self.rank} holds the others back {self.per_step_ms:.1f} ms per step "
                f"({self.share:.0%} of their time){where} (group {self.group}, "
                f"{self.calls} calls)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StragglerBook:
    """This rank's side: its calls' waits (read from the groups' histories) and what its
    user thread ran between calls (sampled)."""

    def __init__(self, comm: Any, start: bool = True) -> None:
        self._comm = weakref.ref(comm)  # the thread must not keep a communicator alive
        self._samples: deque[str] = deque(maxlen=SAMPLES)
        self._groups: dict[str, Any] = {}  #: the last windows seen (kept after destroy)
        self._stop = threading.Event()
        self.on = enabled()
        self.cpu_s = 0.0  #: CPU time the looks took (their whole cost but the GIL's)
        if self.on and start:
            threading.Thread(target=self._loop, name="rankwise-stragglers",
                             daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD):
            cpu = time.thread_time()
            comm = self._comm()
            if comm is None or comm.closed:
                return
            try:
                self.sample(comm)
            except Exception:  # noqa: BLE001, S110 - a look must never hurt the job
                pass
            del comm  # held only during a look
            self.cpu_s += time.thread_time() - cpu

    def sample(self, comm: Any) -> None:
        """One look: where the user's thread is, if it is in its own code (between
        calls). A rank inside a call is waiting; that is not what it runs."""
        if comm.doing is not comm.calls.idle:
            return
        frame = current_frames().get(comm.user_thread)
        if frame is None:
            return
        site, calls = stack_of(frame)
        del frame
        if site.frames:
            self._samples.append(site.short + (f" (calling {calls})" if calls else ""))

    def local(self) -> dict[str, Any]:
        """What this rank contributes to ``attribute``: per group (by id) its last calls as
        ``[seq, wait ms, user-code ms before it, step key]``, and its most seen lines."""
        comm = self._comm()
        groups = dict(self._groups)
        for g in list(comm.groups.values()) if comm is not None else []:
            rows: list[list[Any]] = []
            prev = 0.0
            for c in g.recent(WINDOW):
                if not c.finished:
                    continue  # in flight
                gap = c.started - prev if prev else 0.0
                rows.append([c.seq, round((c.finished - c.started) * 1e3, 3),
                             round(max(0.0, gap) * 1e3, 3),
                             f"{int(c.fp.op)}:{c.fp.count}:{c.site.id}"])
                prev = c.finished
            if rows:
                groups[str(g.id)] = {"name": g.name, "ranks": list(g.ranks), "calls": rows}
        self._groups = groups
        samples = list(self._samples)
        return {"rank": comm.rank if comm is not None else -1, "groups": groups,
                "lines": Counter(samples).most_common(LINES), "samples": len(samples),
                "cpu_s": round(self.cpu_s, 4)}


def book_of(comm: Any) -> dict[str, Any] | None:
    """``comm``'s ``StragglerBook.local()`` for a snapshot or a dump; None when off."""
    book = getattr(comm, "stragglers", None)
    return book.local() if book is not None and book.on else None


def attribute(ranks: Sequence[dict[str, Any] | None]) -> list[Straggler]:
    """The stragglers among ``ranks``' ``StragglerBook.local()``s (any order; missing
    ones None): per group every member reported, one verdict or none."""
    by_rank = {r["rank"]: r for r in ranks if r}
    ids = sorted({gid for r in by_rank.values() for gid in r.get("groups", {})})
    out = []
    for gid in ids:
        found = _group(gid, by_rank)
        if found is not None:
            out.append(found)
    return out


def _group(gid: str, by_rank: dict[int, dict[str, Any]]) -> Straggler | None:
    first = next(r["groups"][gid] for r in by_rank.values() if gid in r.get("groups", {}))
    members, name = first["ranks"], first.get("name", gid)
    if len(members) < 2 or any(gid not in by_rank.get(m, {}).get("groups", {})
                               for m in members):
        return None
    calls = {m: {row[0]: row for row in by_rank[m]["groups"][gid]["calls"]} for m in members}
    seqs = sorted(set.intersection(*(set(c) for c in calls.values())))[-WINDOW:]
    if len(seqs) < MIN_CALLS:
        return None
    last = Counter(min(members, key=lambda m: calls[m][s][1]) for s in seqs)
    slow, times = last.most_common(1)[0]
    if times < MIN_SHARE * len(seqs):
        return None
    others = [m for m in members if m != slow]
    excess = [statistics.median(calls[m][s][1] for m in others) - calls[slow][s][1]
              for s in seqs]
    spent = sum(statistics.median(calls[m][s][1] + calls[m][s][2] for m in others)
                for s in seqs)
    total = sum(max(0.0, e) for e in excess)
    steps = Counter(calls[slow][s][3] for s in seqs).most_common(1)[0][1]
    per_step, share = total / steps, (total / spent if spent > 0 else 0.0)
    if per_step < MIN_MS or share < MIN_FRACTION:
        return None
    return Straggler(slow, name, round(statistics.median(excess), 2), round(per_step, 2),
                     round(share, 3), _line(by_rank[slow], [by_rank[m] for m in others]),
                     len(seqs), steps)


def _shares(book: dict[str, Any]) -> dict[str, float]:
    n = book.get("samples") or 0
    return {line: count / n for line, count in book.get("lines", [])} if n else {}


def _line(slow: dict[str, Any], others: list[dict[str, Any]]) -> str:
    """The straggler's line whose share of its looks most exceeds the others' share of
    the same line: the code it runs while they wait (a line every rank runs as long, the
    forward pass, cancels out)."""
    mine = _shares(slow)
    theirs = [_shares(o) for o in others]
    best, score = "", 0.0
    for line, p in mine.items():
        s = p - (sum(t.get(line, 0.0) for t in theirs) / len(theirs) if theirs else 0.0)
        if s > score:
            best, score = line, s
    return best


def stragglers(group: Any = None) -> list[Straggler]:
    """The ranks that hold ``group``'s other members back now (empty when balanced): a
    collective, every member calls it (it gathers each rank's ``local()``)."""
    from ..api.objects import all_gather_object
    from ..api.world import resolve_group

    g = resolve_group(group)
    if g is None:
        return []
    book = getattr(g.comm, "stragglers", None)
    mine = book.local() if book is not None and book.on else None
    everyone: list[Any] = [None] * g.size()
    all_gather_object(everyone, mine, group=group)
    return [s for s in attribute(everyone) if s.group == g.name]
