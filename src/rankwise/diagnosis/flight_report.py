"""``rankwise analyze`` on torch flight-recorder dumps: the same report as for rankwise's.

Why: torch's ``fr_trace`` prints match errors entry by entry; the question after a hang is
the one ``rankwise analyze`` answers for its own dumps — at which collective, in which
group, did the ranks part (which calls, which sizes or dtypes, which ranks on each side),
who never got there, and where each rank stood, with its stack where the dump has one.
Collectives are compared by ``collective_seq_id`` within a process group, as torch numbers
them; a rank whose ring buffer no longer holds a number is not counted against it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..checks.report import rank_list
from .flight import FlightDump

__all__ = ["flight_report"]

Call = dict[str, Any]


def _ranks_of(dump: FlightDump, pg_name: str) -> list[int] | None:
    config = dump.get("pg_config") or {}
    entry = config.get(pg_name)
    if entry is None and len(config) == 1:  # gloo's default group is filed under ""
        entry = next(iter(config.values()))
    if not isinstance(entry, dict):
        return None
    try:
        ranks = json.loads(entry["ranks"]) if isinstance(entry["ranks"], str) else entry["ranks"]
        return sorted(int(r) for r in ranks)
    except (TypeError, KeyError, ValueError):
        return None


def _site(frames: list[Any]) -> str:
    """The innermost frame outside torch: the user's line that made the call."""
    for f in frames:
        if isinstance(f, dict) and "/torch/" not in str(f.get("filename", "")):
            return f"{f.get('filename')}:{f.get('line')}"
    return ""


def _call(entry: dict[str, Any]) -> Call:
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    ins, outs = entry.get("input_sizes"), entry.get("output_sizes")
    in_t, out_t = entry.get("input_dtypes"), entry.get("output_dtypes")
    frames = entry.get("frames") or []
    return {"op": op, "sizes": (ins, outs), "dtypes": (in_t, out_t),
            "text": f"{op}(sizes {ins}, dtypes {in_t}" + (
                f" -> sizes {outs}, dtypes {out_t})" if (ins, in_t) != (outs, out_t) else ")"),
            "state": str(entry.get("state", "?")), "site": _site(frames), "frames": frames,
            "created": entry.get("time_created_ns") or 0}


def backend_of(entry: dict[str, Any]) -> str:
    """The recorder an entry came from: ``profiling_name``'s prefix ("nccl", torch 2.15's
    "nccl2" and "nccl-lazy", "gloo", "c10d" where torch's hook could not name the backend,
    "rankwise", ...)."""
    return str(entry.get("profiling_name", "")).split(":", 1)[0] if ":" in str(
        entry.get("profiling_name", "")) else ""


Groups = dict[tuple[str, str], tuple[str, list[int], dict[int, dict[int, Call]]]]


def _groups(dumps: dict[int, FlightDump]) -> Groups:
    """(pg name, backend) -> (description, member ranks, rank -> collective seq -> call).
    By backend too: each of torch 2.15's recorders numbers a group's calls itself."""
    out: Groups = {}
    for rank, dump in sorted(dumps.items()):
        for entry in dump.get("entries") or []:
            if not isinstance(entry, dict) or entry.get("is_p2p"):
                continue
            pg = entry.get("process_group") or ("?", "")
            name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
            key = (name, backend_of(entry))
            if key not in out:
                out[key] = (desc, _ranks_of(dump, name) or [], {})
            seq = int(entry.get("collective_seq_id") or 0)
            out[key][2].setdefault(rank, {})[seq] = _call(entry)
    return out


def _label(groups: Groups, name: str, backend: str, desc: str) -> str:
    """``group D``, with its backend where the group is in several recorders."""
    several = len({b for n, b in groups if n == name}) > 1
    return f"group {desc or name}" + (f" [{backend}]" if several and backend else "")


def _side(ranks: list[int], c: Call) -> str:
    return f"{rank_list(ranks)} called {c['text']}" + (f" at {c['site']}" if c["site"] else "")


def _what_differs(calls: list[Call]) -> str:
    keys = [k for k in ("op", "sizes", "dtypes") if len({repr(c[k]) for c in calls}) > 1]
    return " and ".join({"op": "the op", "sizes": "sizes", "dtypes": "dtypes"}[k] for k in keys)


def _divergence(label: str, members: list[int], per_rank: dict[int, dict[int, Call]],
                dumped: set[int]) -> str | None:
    """The earliest collective of one group where the ranks' calls differ or some stop."""
    lowest = {r: min(h) for r, h in per_rank.items() if h}
    highest = {r: max(h) for r, h in per_rank.items() if h}
    for seq in sorted({s for h in per_rank.values() for s in h}):
        sides: dict[str, tuple[list[int], Call]] = {}
        for r, h in sorted(per_rank.items()):
            if seq in h:
                c = h[seq]
                sides.setdefault(repr((c["op"], c["sizes"], c["dtypes"])), ([], c))[0].append(r)
        parts = sorted(sides.values(), key=lambda p: (len(p[0]), p[0][0]))
        head = f"  {label}, collective #{seq}: "
        if len(parts) > 1:
            return (head + "; while ".join(_side(rs, c) for rs, c in parts)
                    + f" ({_what_differs([c for _, c in parts])} disagree).")
        short = sorted(r for r in members if r in dumped and r in highest
                       and highest[r] < seq and lowest[r] <= seq)
        silent = sorted(r for r in members if r in dumped and r not in per_rank)
        absent = sorted(r for r in members if r not in dumped)
        if short or (silent and len(per_rank) > 0):
            missing = [f"{rank_list(short)} never reached it (stopped at "
                       + ", ".join(f"#{highest[r]}" for r in short) + ")"] if short else []
            if silent:
                missing.append(f"{rank_list(silent)} recorded no call in this group")
            if absent:
                missing.append(f"{rank_list(absent)} wrote no dump")
            return head + _side(parts[0][0], parts[0][1]) + "; " + "; ".join(missing) + "."
    return None


def _clock(ns: int) -> str:
    t = ns / 1e9
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _standing(rank: int, label: str, calls: dict[int, Call], dump: FlightDump,
              pg_name: str) -> list[str]:
    last_seq = max(calls)
    last = calls[last_seq]
    done = [s for s, c in calls.items() if c["state"] == "completed"]
    line = f"  rank {rank}, {label}: "
    if last["state"] == "completed":
        line += f"idle after #{last_seq} {last['text']} (completed)"
    else:
        line += (f"in #{last_seq} {last['text']}" + (f" at {last['site']}" if last["site"] else "")
                 + f", state '{last['state']}' since {_clock(int(last['created']))}")
        if done:
            c = calls[max(done)]
            line += f"; last completed #{max(done)} {c['text']}"
        else:
            status = (dump.get("pg_status") or {}).get(str(_pg_id(dump, pg_name)), {})
            line += ("; no entry marked completed (torch's own counters: "
                     + ", ".join(f"{k.replace('_collective', '')} #{v}"
                                 for k, v in sorted(status.items())) + ")"
                     if status else "; no entry marked completed")
    out = [line]
    if last["state"] != "completed" and last["frames"]:
        out += [f"      {f.get('filename')}:{f.get('line')} in {f.get('name')}"
                for f in reversed(last["frames"]) if isinstance(f, dict)]
    return out


def _pg_id(dump: FlightDump, pg_name: str) -> Any:
    for e in dump.get("entries") or []:
        if isinstance(e, dict) and str((e.get("process_group") or ("",))[0]) == pg_name:
            return e.get("pg_id")
    return None


def flight_report(directory: str, dumps: dict[int, FlightDump]) -> str:
    """The post-mortem of one job's flight-recorder dumps (``flight.load_flight_dumps``)."""
    groups = _groups(dumps)
    world = sorted(set(dumps) | {r for _, members, _ in groups.values() for r in members})
    missing = [r for r in world if r not in dumps]
    backends = sorted({backend_of(e) for d in dumps.values() for e in d.get("entries") or []
                       if isinstance(e, dict)} - {""})
    versions = sorted({str(d.get("version")) for d in dumps.values()})
    lines = [f"torch flight-recorder post-mortem of {directory}: {len(dumps)} of {len(world)} "
             f"ranks left a dump (format {', '.join(versions)}, {', '.join(backends) or 'no'} "
             "calls)" + (f"; no dump from {rank_list(missing)}" if missing else "")]
    lines.append("Where the ranks' calls diverged (earliest per group):")
    found = []
    for (name, backend), (desc, members, per_rank) in sorted(groups.items()):
        label = _label(groups, name, backend, desc) + (
            f" ({rank_list(members)})" if members else "")
        line = _divergence(label, members or sorted(per_rank), per_rank, set(dumps))
        if line:
            found.append(line)
    lines += found or ["  nowhere in the kept entries: every rank made the same calls"]
    lines.append("Where each rank was (its last call per group; stack where the dump has it):")
    for (name, backend), (desc, _, per_rank) in sorted(groups.items()):
        for rank, calls in sorted(per_rank.items()):
            lines += _standing(rank, _label(groups, name, backend, desc), calls, dumps[rank],
                               name)
    for r in missing:
        lines.append(f"  rank {r}: unknown (no dump)")
    return "\n".join(lines)
