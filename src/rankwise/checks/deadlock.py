"""Deadlock detection: "all ranks are asleep", across every group and point-to-point.

Why: a job whose ranks wait for each other in different groups (ranks 0-2 in a barrier
of a sub-group, rank 3 in an all_reduce of WORLD) can never proceed, yet without this it
waits for the warning timer (30 s) and then for the timeout. Go answers the same question
for goroutines ("all goroutines are asleep - deadlock!"); here the ranks are processes,
so the answer is gathered with the who-is-where machinery (``checks.where``).

Cost: nothing on the fast path. Only the job's prober (its lowest-numbered live rank)
looks: when the other ranks' waits have told it they lasted ``RANKWISE_DEADLOCK_AFTER``
seconds (default 1), and on its own wait's back-off. A look is N-1 answers, a wave of
waits N-1 notes (``checks.prober``, docs/scale.md). ``RANKWISE_DEADLOCK=0`` turns it off.

The verdict is conservative; "deadlock" needs all of:
- every live rank answered and reports a rankwise call in progress, with no async work in
  flight in its process (a queued ``async_op`` call may still satisfy someone's wait) and
  no failure already being reported;
- no blocked wait can be satisfied by the others' current state: a collective ``#s`` of
  group ``g`` completes once every member has begun its ``#s`` of ``g`` (``seqs``), so a
  collective whose members are all there is progress (or a mismatch, reported elsewhere);
  a blocked ``recv`` is satisfied by nobody when every rank is blocked in a receive or a
  collective (blocking sends do not report a call, so a sending rank looks busy);
- a second look ``CONFIRM_GAP`` seconds later shows every rank in the very same call
  (same start time, same per-group sequence numbers): nothing moved.
A look that finds no deadlock but ranks in the same collective (``#s`` of ``g``) with
different calls reports that instead, as a mismatch on every rank: nothing moves there
either, as when one rank's CUDA tensors went to NCCL and another's host memory to the
CPU engine, planes that exchange no headers to compare.
Limitation: a rank whose blocked thread waits for data another thread *of the same rank*
will send after computing looks blocked; set ``RANKWISE_DEADLOCK=0`` for such programs.
"""

from __future__ import annotations

from typing import Any

from .report import rank_list

__all__ = ["CONFIRM_GAP", "blocked_state", "cycle_of", "find_deadlock", "snapshot",
           "wait_edges", "wait_lines"]

CONFIRM_GAP = 0.5  #: seconds between the two looks that must agree

Report = dict[str, Any]


def blocked_state(comm: Any) -> dict[str, Any]:
    """What the detector needs beyond the who-is-where report: async work in flight, the
    sequence number each group has reached, the members of the group blocked in, and the
    blocked call's start time (which tells a second look whether anything moved)."""
    from ..core.work import in_flight  # core builds on checks: not at module level

    a = comm.activity
    groups = dict(comm.groups)
    state: dict[str, Any] = {
        "async": in_flight(comm),
        "since": a.since,
        "seqs": {str(gid): int(g.seq) for gid, g in groups.items()},
        "names": {str(gid): str(g.name) for gid, g in groups.items()},
    }
    if a.op and a.kind != "recv":
        group = groups.get(a.group)
        state["members"] = list(group.ranks) if group is not None else []
    return state


def _waits(rep: Report, reports: dict[int, Report]) -> list[int] | None:
    """The live ranks ``rep``'s blocked call waits for, or None if the call can still
    complete (or the others' state cannot prove it cannot)."""
    me = int(rep.get("rank", -1))
    if rep.get("kind") == "recv":
        src = int(rep.get("waiting_for", -1))
        if src < 0:
            return [r for r in reports if r != me]
        return [src] if src in reports else None  # a gone peer: PeerFailure tells
    b = rep["blocked"]
    gid, seq = str(rep.get("group", 0)), int(rep.get("seq", 0))
    members = b.get("members") or []
    missing: list[int] = []
    for m in members:
        theirs = reports.get(int(m))
        if theirs is None:
            return None  # a member left or died: its failure is reported, not a deadlock
        if int(((theirs.get("blocked") or {}).get("seqs") or {}).get(gid, 0)) < seq:
            missing.append(int(m))
    return missing or None


def _group_name(rep: Report) -> str:
    gid = str(rep.get("group", 0))
    b = rep.get("blocked") or {}
    name = (b.get("names") or {}).get(gid) or f"group {gid}"
    members = b.get("members")
    if not members or "[" in str(name):  # new_group's default name lists its members
        return str(name)
    return f"{name} [{rank_list(members)}]"


def _doing(rep: Report) -> str:
    """``barrier() #2 of sub (ranks 0-3) at prog.py:12 in main`` for one rank."""
    site = rep.get("chain") or rep.get("site") or "<unknown>"
    if rep.get("kind") == "recv":
        src = int(rep.get("waiting_for", -1))
        who = "any rank" if src < 0 else f"rank {src}"
        return f"recv from {who} at {site}"
    call = rep.get("call") or f"{rep.get('op', '?')}()"
    return f"{call} #{rep.get('seq', '?')} of {_group_name(rep)} at {site}"


def _cycle(edges: dict[int, list[int]]) -> list[int]:
    """One cycle of the wait-for graph (ranks in order), or [] (then nobody can be woken
    without one: every chain of waits ends at a rank that is blocked elsewhere)."""
    state: dict[int, int] = {}
    stack: list[int] = []

    def visit(node: int) -> list[int]:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return list(found)
    return []


def find_deadlock(reports: dict[int, Report], found_by: int
                  ) -> tuple[str, dict[int, str]] | None:
    """The deadlock these who-is-where reports show, as (message, {rank: its call}), or
    None when some rank may still proceed (see the module docstring for the rule)."""
    live = {r: rep for r, rep in reports.items() if not rep.get("gone")}
    if len(live) < 2:
        return None
    for rep in live.values():
        b = rep.get("blocked")
        if (rep.get("no_answer") or rep.get("failed") or not rep.get("op")
                or not isinstance(b, dict) or b.get("async")):
            return None
    edges: dict[int, list[int]] = {}
    for r, rep in live.items():
        waits = _waits(rep, live)
        if not waits:
            return None
        edges[r] = waits
    calls = {r: _doing(rep) for r, rep in live.items()}
    headline = (f"deadlock: all {len(live)} live ranks are blocked in rankwise calls and none "
                f"of them can ever proceed (found by rank {found_by} once every rank had "
                "waited about a second, and confirmed by a second look):")
    lines = [headline]
    lines += wait_lines(live, edges)
    cycle = cycle_of(edges)
    if cycle:
        lines.append(cycle)
    lines.append(
        "Every rank of a group must make the group's collective calls in the same order; a "
        "collective that only some ranks reach (an `if rank == ...:` branch), calls of "
        "different groups in different orders, or blocking recvs that nobody sends to wait "
        "forever. Order the calls the same way on every rank, or post receives with irecv "
        "/ batch_isend_irecv. (RANKWISE_DEADLOCK=0 turns this check off.)")
    return "\n".join(lines), calls


def wait_edges(reports: dict[int, Report]) -> dict[int, list[int]]:
    """Who waits for whom among ``reports``' blocked ranks (for post-mortems: a rank
    whose wait the others' state satisfies, or whose state is unknown, has no edge)."""
    live = {r: rep for r, rep in reports.items() if not rep.get("gone")}
    edges: dict[int, list[int]] = {}
    for r, rep in live.items():
        if rep.get("op") and isinstance(rep.get("blocked"), dict):
            waits = _waits(rep, live)
            if waits:
                edges[r] = waits
    return edges


def wait_lines(reports: dict[int, Report], edges: dict[int, list[int]]) -> list[str]:
    """``  ranks 0-2: barrier() #1 of ... at f.py:9, waiting for rank 3, which has not
    reached it`` — one line per distinct blocked call, ranks with the same call merged."""
    lines: list[str] = []
    by_call: dict[str, list[int]] = {}
    for r in sorted(edges):
        by_call.setdefault(_doing(reports[r]), []).append(r)
    for call, ranks in sorted(by_call.items(), key=lambda kv: kv[1][0]):
        waits = sorted({w for r in ranks for w in edges[r]} - set(ranks))
        recv = reports[ranks[0]].get("kind") == "recv"
        why = ("which is not sending" if recv and len(waits) == 1 else
               "which are not sending" if recv else
               "which has not reached it" if len(waits) == 1 else "which have not reached it")
        lines.append(f"  {rank_list(ranks)}: {call}, waiting for {rank_list(waits)}, {why}"
                     if waits else f"  {rank_list(ranks)}: {call}")
    return lines


def cycle_of(edges: dict[int, list[int]]) -> str:
    """``Wait-for cycle: rank 0 -> rank 3 -> rank 0.``, or "" when there is none."""
    cycle = _cycle(edges)
    if not cycle:
        return ""
    return ("Wait-for cycle: " + " -> ".join(f"rank {r}" for r in cycle)
            + f" -> rank {cycle[0]}.")


def snapshot(rep: Report) -> tuple[Any, ...]:
    """What two looks compare: the blocked call and every group's sequence number."""
    b = rep.get("blocked") or {}
    return (rep.get("op"), rep.get("kind"), rep.get("group"), rep.get("seq"),
            b.get("since"), tuple(sorted((b.get("seqs") or {}).items())), b.get("async"))
