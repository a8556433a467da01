"""Shared helpers for the error tests (``test_errors_*.py``, ``test_wire_fuzz.py``).

Rank functions for ``run_ranks`` live in the test modules themselves (they must be
importable by module name in spawned children); this module holds only what several
of those modules need: a misuse checker that collects problems instead of stopping at
the first one, assertions over every rank's result, and a bounded subprocess runner for
cases that must let an exception escape to ``sys.excepthook``.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from _procs import start, wait_all
from _zygote import Zygote

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
THIS_DIR = os.path.dirname(os.path.abspath(__file__))


def expect(problems: list[str], name: str, fn: Callable[[], Any], exc_name: str,
           *needles: str) -> str:
    """Run ``fn``; it must raise an exception whose MRO has ``exc_name`` and whose message
    contains every needle (case-insensitive). Anything else is appended to ``problems``.
    Returns the message (or "")."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - we classify everything
        names = [c.__name__ for c in type(exc).__mro__]
        msg = str(exc)
        if exc_name not in names:
            problems.append(f"{name}: raised {type(exc).__name__} ({msg[:300]}), "
                            f"expected {exc_name}")
            return msg
        low = msg.lower()
        missing = [n for n in needles if n.lower() not in low]
        if missing:
            problems.append(f"{name}: message lacks {missing}: {msg[:400]}")
        return msg
    problems.append(f"{name}: did not raise (expected {exc_name})")
    return ""


def assert_every_rank(results: Iterable[Any], exc_name: str, *needles: str,
                      within: float | None = None, ranks: Iterable[int] | None = None) -> None:
    """Every (selected) rank raised ``exc_name`` with all ``needles`` in its message, and
    (if ``within``) did so within ``within`` seconds of starting its function."""
    results = list(results)
    wanted = set(ranks) if ranks is not None else {r.rank for r in results}
    for res in results:
        if res.rank not in wanted:
            continue
        assert res.raised(exc_name), (
            f"rank {res.rank}: expected {exc_name}, got {res.error_type}: {res.message[:800]}"
            f"\n{res.traceback[-2000:]}")
        for needle in needles:
            assert needle.lower() in res.message.lower(), (
                f"rank {res.rank}: {exc_name} message lacks {needle!r}:\n{res.message[:1500]}")
        if within is not None:
            assert res.elapsed < within, (
                f"rank {res.rank}: {exc_name} came after {res.elapsed:.1f}s (bound {within}s)")


def run_script(code: str, *args: str, timeout: float = 30.0,
               env: dict[str, str] | None = None, zygote: Zygote | None = None) -> Any:
    """Start ``python -c code args...`` with rankwise importable (not waited for: pair it
    with ``finish``); forked from ``zygote`` (``_zygote``: torch imported once) if given."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = SRC + os.pathsep + THIS_DIR + os.pathsep + \
        full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    if zygote is not None:
        return zygote.start(textwrap.dedent(code), list(args), full_env)
    return start([sys.executable, "-c", textwrap.dedent(code), *args], env=full_env, cwd=None)


#: wait for every process (one shared bound); kill them all and fail loudly on a hang
finish = wait_all


def line_of(path: str, marker: str) -> int:
    """1-based line number of the first line of ``path`` containing ``marker``."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if marker in line:
                return i
    raise AssertionError(f"marker {marker!r} not in {path}")
