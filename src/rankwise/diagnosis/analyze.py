"""``rankwise analyze dir``: one report from the ranks' ``RANKWISE_DUMP`` files.

Why: after a job died, N per-rank files (``diagnosis.dump``) hold the evidence; the
question is the same every time — which rank failed first, where did the ranks' calls
part, and who was waiting for whom. This answers it in plain text, from the files alone
(no job, no torch), reusing the live diagnosis: the divergence rule of
``checks.report`` and the wait-for graph of ``checks.deadlock``.

Each rank's own report is the truth about that rank; a rank without a file (SIGKILLed, its
machine gone) is described from the other ranks' views of it, marked as such.

A directory of torch flight-recorder dumps (a plain "gloo" or "nccl" job) gets the same
report from ``flight_report``, read by ``flight`` without unpickling any class.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..checks.deadlock import cycle_of, wait_edges, wait_lines
from ..checks.report import _histories, _partition, _reached, rank_list
from ..checks.stragglers import attribute
from .flight import load_flight_dumps
from .flight_report import flight_report

__all__ = ["analyze", "load", "main"]

Report = dict[str, Any]


def load(directory: str) -> dict[int, dict[str, Any]]:
    """Every ``rank<N>.json`` of ``directory``, by rank (unreadable files are skipped)."""
    dumps: dict[int, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        m = re.fullmatch(r"rank(\d+)\.json", name)
        if not m:
            continue
        try:
            with open(os.path.join(directory, name)) as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            dumps[int(m.group(1))] = record
    return dumps


def _reports(dumps: dict[int, dict[str, Any]]
             ) -> tuple[dict[int, Report], dict[int, Report], list[int]]:
    """(histories, states, ranks described second-hand). Histories: each rank's own
    report (the most complete), else another rank's view. States: a report taken at the
    failure (the deadlock's confirming look), else one taken while the rank was still in
    a call (its own, then others' views), else its own."""
    own = {r: d["report"] for r, d in dumps.items() if isinstance(d.get("report"), dict)}
    views: dict[int, list[Report]] = {}
    at_failure: dict[int, Report] = {}
    for d in sorted(dumps.values(), key=lambda d: -float(d.get("written", 0))):
        for key, rep in (d.get("view") or {}).items():
            if key.isdigit() and isinstance(rep, dict) and not rep.get("no_answer"):
                views.setdefault(int(key), []).append(rep)
        for key, rep in (d.get("at_failure") or {}).items():
            if key.isdigit() and isinstance(rep, dict) and not rep.get("no_answer"):
                at_failure.setdefault(int(key), rep)
    histories: dict[int, Report] = dict(own)
    second_hand: list[int] = []
    for r, reps in views.items():
        if r not in histories:
            histories[r] = reps[0]
            second_hand.append(r)
    states: dict[int, Report] = {}
    for r in set(own) | set(views) | set(at_failure):
        candidates = ([at_failure[r]] if r in at_failure else []) + \
            [rep for rep in [own.get(r), *views.get(r, [])] if rep is not None]
        states[r] = next((rep for rep in candidates if rep.get("op")), candidates[0])
    return histories, states, sorted(second_hand)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _first_failures(dumps: dict[int, dict[str, Any]]) -> list[str]:
    events = sorted((float(e.get("time", 0)), r, str(e.get("reason", "")))
                    for r, d in dumps.items() for e in (d.get("events") or [])[:1])
    lines = []
    for i, (t, r, reason) in enumerate(events):
        head = reason.strip().splitlines()[0] if reason.strip() else "?"
        lines.append(f"  {_clock(t)} rank {r}: {head[:300]}" + ("  <- first" if i == 0 else ""))
    return lines


def _divergence(reports: dict[int, Report]) -> list[str]:
    """The earliest collective, per group, where the ranks' calls or call stacks differ,
    or where some members stopped before the others went on."""
    lines: list[str] = []
    gids = sorted({int(g) for rep in reports.values() for g in (rep.get("history") or {})})
    for gid in gids:
        hist = _histories(reports, gid)
        if len(hist) < 2:
            continue
        name = next((str((rep.get("groups") or {}).get(str(gid))) for rep in reports.values()
                     if (rep.get("groups") or {}).get(str(gid))), f"group {gid}")
        reached = {r: max(h) if h else 0 for r, h in hist.items()}
        for seq in sorted({s for h in hist.values() for s in h}):
            parts = _partition(hist, seq)
            if len(parts) > 1:
                lines.append(f"  {name}, collective #{seq}: "
                             + "; while ".join(_reached(rs, e) for rs, e in parts) + ".")
                break
            short = sorted(r for r, top in reached.items() if top < seq)
            if short:
                have = sorted(set(hist) - set(short))
                lines.append(f"  {name}, collective #{seq}: {_reached(have, parts[0][1])}; "
                             f"{rank_list(short)} never reached it (stopped at "
                             + ", ".join(f"#{reached[r]}" for r in short) + ").")
                break
    return lines


def analyze(directory: str) -> str:
    """The merged post-mortem of the dump files in ``directory``, as text."""
    dumps = load(directory)
    if not dumps:
        flight = load_flight_dumps(directory)
        if flight:
            return flight_report(directory, flight)
        return (f"no rank<N>.json dump files in {directory} (was RANKWISE_DUMP set?) and no "
                "torch flight-recorder dumps (<TORCH_FR_DUMP_TEMP_FILE><rank>) either")
    world = max(int(d.get("world_size", 0)) for d in dumps.values())
    histories, states, second_hand = _reports(dumps)
    missing = [r for r in range(world) if r not in dumps]
    lines = [f"rankwise post-mortem of {directory}: {len(dumps)} of {world} ranks wrote a dump"
             + (f" (no file from {rank_list(missing)})" if missing else "")]
    lines.append("What happened, in order (each rank's first event):")
    lines += _first_failures(dumps)
    divergence = _divergence(histories)
    lines.append("Where the ranks' calls diverged (earliest per group):")
    lines += divergence or ["  nowhere in the kept histories: every rank made the same calls"]
    edges = wait_edges(states)
    lines.append("Who waited for whom:")
    lines += wait_lines(states, edges) or ["  no rank was blocked on another"]
    cycle = cycle_of(edges)
    if cycle:
        lines.append("  " + cycle)
    held = attribute([d.get("stragglers") for d in dumps.values()])  # checks.stragglers
    lines += ["Who held the others back (the last calls before the dumps):"]
    lines += [f"  straggler: {s}" for s in held] or ["  nobody: the ranks arrived together"]
    lines.append("Where each rank was:")
    for r in range(world):
        rep = states.get(r)
        state = rep.get("state", "?") if rep else "unknown (no dump, and nobody saw it)"
        note = " (as another rank saw it)" if r in second_hand else ""
        lines.append(f"  rank {r}: {state}{note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rankwise analyze",
        description="Merge the per-rank post-mortem files that RANKWISE_DUMP=dir left into "
                    "one report: who failed first, where the ranks diverged, who waited for "
                    "whom. A directory of torch flight-recorder dumps (TORCH_FR_BUFFER_SIZE, "
                    "pickle or JSON, one per rank, named <prefix><rank>) gets the same "
                    "report; pickles are read without loading any class.")
    parser.add_argument("directory", help="the RANKWISE_DUMP directory, or the directory "
                                          "of a job's flight-recorder dumps")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not os.path.isdir(ns.directory):
        parser.error(f"{ns.directory} is not a directory")
    print(analyze(ns.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
