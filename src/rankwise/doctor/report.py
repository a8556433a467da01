"""Findings as text for people (problems first, context with ``verbose``) or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .findings import Finding

__all__ = ["render_json", "render_text"]


def _block(f: Finding) -> str:
    lines = [f"{f.severity.name.lower():7} [{f.check}] {f.what}"]
    if f.evidence:
        lines.append(f"        evidence: {f.evidence}")
    if f.fix:
        lines.append(f"        fix: {f.fix}")
    return "\n".join(lines)


def render_text(findings: Sequence[Finding], verbose: bool = False) -> str:
    problems = sorted((f for f in findings if f.problem), key=lambda f: -f.severity)
    shown = problems + ([f for f in findings if not f.problem] if verbose else [])
    if problems:
        head = f"rankwise doctor: {len(problems)} problem(s) found"
    else:
        head = "rankwise doctor: no problems found" + ("" if verbose else " (-v shows what was "
                                                               "checked)")
    return "\n".join([head, *(_block(f) for f in shown)])


def render_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"ok": not any(f.problem for f in findings),
                       "findings": [f.as_dict() for f in findings]}, indent=2)

