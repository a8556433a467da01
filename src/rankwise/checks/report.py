"""Who-is-where reports, the divergence analysis and p2p cycle detection.

Why here and not in the communicator: this is all slow-path text building, run only
when something is already wrong (a wait passed its warning threshold, a timeout, a
mismatch). Each rank contributes a small JSON report (``build_report``, answered by the
I/O thread even while the user's thread computes); the asking rank turns the reports
into one table (``format_where``) or, after a mismatch, into the answer to "where did
the ranks' histories part?" (``mismatch_report``).

The divergence rule: walking back from the collective that failed, the ranks' calls
keep differing (different call stacks, or different arguments) until the last one where
every rank made the same call from the same code. The collective after that point is
where they went out of step — the bug (for the seed-000 trap: the barrier reached from
the rank-0-only validation loader), even though it "succeeded" because barriers from
different code pair silently. Differing stacks alone are never reported: pairing
barriers from different code is legal (rank-0-first does it), so this analysis runs
only once a collective has actually failed.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from ..identity.calls import describe
from ..identity.callsite import stack_of
from ..identity.stacks import current_frames

__all__ = ["build_report", "find_cycle", "format_where", "mismatch_report", "rank_list",
           "reported_shape", "stalled_mismatch"]

HISTORY_SENT = 16  #: calls per group a rank puts in its report
GROUPS_SENT = 16  #: groups per report (most recently created)


def rank_list(ranks: list[int]) -> str:
    """``rank 0`` / ``ranks 1-3`` / ``ranks 0, 2, 5-7``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else
                     f"{start}-{prev}" if prev > start + 1 else f"{start}, {prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


def _state(comm: Any, now: float) -> str:
    a = comm.activity
    since = max(0.0, now - a.since)
    if a.op and a.kind == "recv":
        src = "any rank" if a.waiting_for < 0 else f"rank {a.waiting_for}"
        return (f"blocked in recv from {src} (tag {a.tag}) at {a.site.chain} "
                f"for {since:.1f}s")
    if a.op:
        group = comm.groups.get(a.group)
        gname = group.name if group is not None else f"group {a.group}"
        where = a.site.chain or "<unknown>"
        if a.enqueued:
            # the op is in a foreign engine's hands: started here, waiting on its peers
            # (or, on a GPU, on its kernel), not on anything rankwise still has to do
            what = "kernel" if a.engine.startswith("nccl") else "op"
            text = (f"enqueued {comm.call_of(a)} #{a.seq} of {gname} on {a.engine} at "
                    f"{where}, {what} not finished after {max(0.0, now - a.enqueued):.1f}s")
        else:
            text = f"in {comm.call_of(a)} #{a.seq} of {gname} at {where} for {since:.1f}s"
        if a.waiting_for >= 0:
            text += f", waiting for rank {a.waiting_for}"
        if a.patient:
            text += " (rank_zero_first: waiting, without timeout, for rank 0's block)"
        return text
    last = comm.last_call
    return (f"running user code{_busy_at(comm.user_thread)}, {since:.1f} s"
            + (f" (last call: {last})" if last else " (no collective yet)"))


def _busy_at(thread: int) -> str:
    """`` at train.py:7 in load_data <- train.py:12 in main (time.sleep)``: where the
    user's thread is now. Read only here, when someone asks where this rank is (the
    responder thread answering WHERE): the fast path never looks at stacks."""
    frame = current_frames().get(thread)
    if frame is None:
        return " (its thread has ended)"
    site, callee = stack_of(frame)
    if not site.frames:
        return ""
    return f" at {site.chain}" + (f" ({callee})" if callee else "")


def build_report(comm: Any) -> dict[str, Any]:
    """This rank's answer to WHERE: state, what it waits for, recent calls per group."""
    now = time.time()
    a = comm.activity
    report: dict[str, Any] = {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "state": _state(comm, now),
        "op": a.op,
        "kind": a.kind if a.op else "",
        "group": a.group,
        "seq": a.seq,
        "waiting_for": a.waiting_for if a.op else -1,
        "patient": bool(a.patient),
        "site": a.site.short if a.op else "",
        "chain": a.site.chain if a.op else "",
        "call": comm.call_of(a) if a.op and a.kind != "recv" else "",
        "fp": _fingerprint_of(comm, a) if a.op and a.kind != "recv" else "",
        "enqueued": bool(a.op and a.enqueued),
    }
    failure = comm.router.failure
    if failure is not None:
        report["failed"] = f"{type(failure).__name__}: {str(failure)[:300]}"
    history: dict[str, list[dict[str, Any]]] = {}
    names: dict[str, str] = {}
    for gid, group in list(comm.groups.items())[-GROUPS_SENT:]:
        entries = []
        for rec in group.recent(HISTORY_SENT):
            entries.append({
                "seq": rec.seq,
                "call": rec.describe(site=False),
                "fp": _describe(rec.fp),
                "shape": list(rec.shape) if rec.shape is not None else None,
                "site": rec.site.short,
                "chain": rec.site.chain,
                "done": rec.finished > 0,
            })
        history[str(gid)] = entries
        names[str(gid)] = group.name
    report["history"] = history
    report["groups"] = names
    return report


def _describe(fp: Any) -> str:
    """The call as ranks compare it (element counts, not shapes): the key that says
    whether two ranks' calls agree; the "call" text next to it is for the reader."""
    return describe(fp)


def _fingerprint_of(comm: Any, a: Any) -> str:
    group = comm.groups.get(a.group)
    record = group.record_of(a.seq) if group is not None else None
    return _describe(record.fp) if record is not None else comm.call_of(a)


def reported_shape(reports: dict[int, dict[str, Any]], rank: int, group: int, seq: int
                   ) -> tuple[int, ...] | None:
    """The shape of ``rank``'s tensor in collective ``seq`` of ``group``, from its own
    report: frames carry element counts only, so a peer's shape comes from here."""
    entries = ((reports.get(rank) or {}).get("history") or {}).get(str(group))
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and e.get("seq") == seq and isinstance(e.get("shape"), list):
            dims = e["shape"]
            if len(dims) <= 64 and all(isinstance(d, int) for d in dims):
                return tuple(dims)
    return None


# --- who is where --------------------------------------------------------------------------

def find_cycle(reports: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks that block on each other in a cycle (each waits for the next), or [].

    Ranks inside one and the same collective wait for each other all the time while
    its data moves (a ring is such a cycle at every step), so a cycle whose ranks are
    all in the same collective call is progress, not a deadlock.
    """
    edges: dict[int, int] = {}
    for r, rep in reports.items():
        w = rep.get("waiting_for", -1)
        if rep.get("op") and isinstance(w, int) and w >= 0 and w != r:
            edges[r] = w
    for start in sorted(edges):
        path: list[int] = []
        seen: dict[int, int] = {}
        node: int | None = start
        while node is not None and node in edges and node not in seen:
            seen[node] = len(path)
            path.append(node)
            node = edges[node]
        if node is not None and node in seen:
            cycle = path[seen[node]:]
            if not _one_collective(reports, cycle):
                return cycle
    return []


def _one_collective(reports: dict[int, dict[str, Any]], ranks: list[int]) -> bool:
    calls = {(reports[r].get("group"), reports[r].get("seq")) for r in ranks}
    return len(calls) == 1 and all(reports[r].get("kind") != "recv" for r in ranks)


def _wait_text(rep: dict[str, Any]) -> str:
    if rep.get("kind") == "recv":
        return f"recv at {rep.get('site', '?')}"
    return f"{rep.get('op', '?')} #{rep.get('seq', '?')} at {rep.get('site', '?')}"


def cycle_text(reports: dict[int, dict[str, Any]]) -> str:
    cycle = find_cycle(reports)
    if not cycle:
        return ""
    steps = [f"rank {r} waits for rank {reports[r]['waiting_for']} ({_wait_text(reports[r])})"
             for r in cycle]
    text = steps[0] + "".join(f", which waits for rank {reports[r]['waiting_for']} "
                              f"({_wait_text(reports[r])})" for r in cycle[1:])
    p2p = any(reports[r].get("kind") == "recv" for r in cycle)
    return ("DEADLOCK: " + text + ": a cycle of blocking waits, none of these ranks can "
            "proceed." + (" Post receives with irecv before sending, use batch_isend_irecv, "
                          "or order blocking send/recv by rank (even ranks send first)."
                          if p2p else ""))


def format_where(reports: dict[int, dict[str, Any]], headline: str) -> str:
    """One table: a line per rank, then the wait cycle if there is one."""
    lines = [f"who is where ({headline}):"]
    held = _enqueued_ops(reports)
    for r in sorted(reports):
        lines.append(f"  rank {r}: {reports[r].get('state', '?')}{_never_called(reports[r], held)}")
    cycle = cycle_text(reports)
    if cycle:
        lines.append(cycle)
    return "\n".join(lines)


def _enqueued_ops(reports: dict[int, dict[str, Any]]) -> dict[tuple[int, int], str]:
    """The collectives (group, seq) some rank handed to a foreign engine, by their call."""
    return {(int(rep.get("group", 0)), int(rep.get("seq", 0))): str(rep.get("call"))
            for rep in reports.values() if rep.get("enqueued")}


def _never_called(rep: dict[str, Any], held: dict[tuple[int, int], str]) -> str:
    """``; never called all_reduce(...) #12`` for a rank whose history of that group
    stops before a collective another rank has enqueued (it is elsewhere, not slow)."""
    notes = []
    for (gid, seq), call in sorted(held.items()):
        if rep.get("op") and (int(rep.get("group", 0)), int(rep.get("seq", 0))) == (gid, seq):
            continue
        entries = (rep.get("history") or {}).get(str(gid))
        if isinstance(entries, list) and entries and \
                all(int(e.get("seq", 0)) < seq for e in entries if isinstance(e, dict)):
            notes.append(f"; never called {call} #{seq}")
    return "".join(notes)


def stalled_mismatch(reports: dict[int, dict[str, Any]]
                     ) -> tuple[int, int, dict[str, list[int]]] | None:
    """Ranks blocked in the *same* collective (group, seq) with different calls: a
    mismatch no frame revealed (crossed roots: every rank waits to receive, nobody
    sends). Returns (group, seq, {call: ranks}) or None."""
    seen: dict[tuple[int, int], dict[str, list[int]]] = {}
    shown: dict[str, str] = {}
    for r, rep in reports.items():
        if rep.get("op") and rep.get("kind") == "collective" and rep.get("call"):
            key = (int(rep.get("group", 0)), int(rep.get("seq", 0)))
            agree = str(rep.get("fp") or rep["call"])  # shapes may differ, counts not
            shown.setdefault(agree, str(rep["call"]))
            seen.setdefault(key, {}).setdefault(agree, []).append(r)
    for key in sorted(seen):
        if len(seen[key]) > 1:
            return key[0], key[1], {shown[k]: ranks for k, ranks in seen[key].items()}
    return None


# --- where the histories diverged ------------------------------------------------------------

def _histories(reports: dict[int, dict[str, Any]], group: int
               ) -> dict[int, dict[int, dict[str, Any]]]:
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for r, rep in reports.items():
        entries = (rep.get("history") or {}).get(str(group))
        if isinstance(entries, list):
            out[r] = {int(e["seq"]): e for e in entries if isinstance(e, dict) and "seq" in e}
    return out


def _partition(hist: dict[int, dict[int, dict[str, Any]]], seq: int
               ) -> list[tuple[list[int], dict[str, Any]]]:
    """Ranks grouped by the call (args and call stack) they made as collective ``seq``."""
    groups: dict[tuple[str, str], list[int]] = {}
    sample: dict[tuple[str, str], dict[str, Any]] = {}
    for r in sorted(hist):
        e = hist[r].get(seq)
        if e is None:
            continue
        key = (str(e.get("fp") or e.get("call")), str(e.get("chain")))
        groups.setdefault(key, []).append(r)
        seen = sample.setdefault(key, e)
        if seen.get("call") != e.get("call"):  # same counts, other shapes: show counts
            sample[key] = {**seen, "call": seen.get("fp") or seen.get("call")}
    parts = [(ranks, sample[k]) for k, ranks in groups.items()]
    parts.sort(key=lambda p: (len(p[0]), p[0][0]))  # the odd one out first
    return parts


def _reached(ranks: list[int], e: dict[str, Any]) -> str:
    where = e.get("chain") or "<unknown site>"
    return f"{rank_list(ranks)} reached {e.get('call')} at {where}"


def mismatch_report(reports: dict[int, dict[str, Any]], group: int, seq: int, me: int,
                    other: int) -> str:
    """The earliest collective where the ranks' calls parted, the recent history of
    every rank side by side, and where each rank is now."""
    hist = _histories(reports, group)
    gname = next((str((rep.get("groups") or {}).get(str(group))) for rep in reports.values()
                  if (rep.get("groups") or {}).get(str(group))), f"group {group}")
    lines: list[str] = []
    known = [s for h in hist.values() for s in h]
    if len(hist) >= 2 and known:
        lo = min(known)
        start = seq

        def differs(s: int) -> bool:
            parts = _partition(hist, s)
            return len(parts) > 1

        exhausted = False
        while True:
            prev = start - 1
            if prev < 1:
                break
            if prev < lo or sum(1 for h in hist.values() if prev in h) < 2:
                exhausted = prev >= 1
                break
            if not differs(prev):
                break
            start = prev
        parts = _partition(hist, start)
        if len(parts) > 1:
            lines.append(f"Where the ranks diverged: collective #{start} of {gname}: "
                         + "; while ".join(_reached(r, e) for r, e in parts) + ".")
            if start < seq:
                done = (f"Collective #{start} still completed because its calls were"
                        if start == seq - 1 else
                        f"Collectives #{start}..#{seq - 1} still completed because their calls "
                        "were")
                lines.append(
                    f"{done} compatible (two barriers from different code pair silently); "
                    f"#{seq} is the first that could not pair. Look at #{start}: "
                    "a collective reached on some ranks only (an `if rank == 0:` branch, an "
                    "uneven loop) shifts every later call.")
            else:
                lines.append(f"Up to #{seq - 1} every rank made the same calls from the same "
                             "code.")
            if exhausted:
                lines.append(f"(the histories kept by the ranks do not reach before "
                             f"#{lo}; the divergence may be earlier)")
        else:
            lines.append(f"Where the ranks diverged: at collective #{seq} of {gname} "
                         "(same call stacks before it).")
        first = max(lo, start - 3)
        lines.append(f"Recent collectives of {gname}, per rank:")
        for s in range(first, seq + 1):
            parts = _partition(hist, s)
            if not parts:
                continue
            if len(parts) == 1 and len(parts[0][0]) == len(hist):
                e = parts[0][1]
                row = f"all ranks: {e.get('call')} at {e.get('site')}"
            else:
                row = " | ".join(f"{rank_list(r)}: {e.get('call')} at {e.get('site')}"
                                 for r, e in sorted(parts, key=lambda p: p[0][0]))
            mark = "  <- diverged" if s == start and len(parts) > 1 else (
                "  <- failed" if s == seq else "")
            lines.append(f"  #{s:<4} {row}{mark}")
    else:
        lines.append("(no history from the other ranks: the divergence point is unknown)")
    lines.append("Where each rank is now:")
    for r in sorted(reports):
        lines.append(f"  rank {r}: {reports[r].get('state', '?')}")
    return "\n".join(lines)
