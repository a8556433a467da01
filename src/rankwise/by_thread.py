"""Values kept per thread in a dict by thread id, for a hot path that asks on every call.

Why not ``threading.local``: reading one costs ~500 instructions (the thread's dict is
found, then the name in it); an empty ``ByThread`` answers with one truth test, a full
one with ``get_ident()`` and a dict lookup (docs/gpu.md). What a thread-local does by
itself is done here: a thread's value goes when it sets None (its owner's ``finally``),
and a forked child, which has only the thread that forked, keeps only that thread's
value (another thread of the child may get an id of the parent's threads).
"""

from __future__ import annotations

import os
from threading import get_ident
from typing import Any, Generic, TypeVar

__all__ = ["ByThread"]

T = TypeVar("T")

#: every table made (module globals, as long-lived as the process): a fork trims them
_tables: list[ByThread[Any]] = []


class ByThread(dict[int, T], Generic[T]):
    """``{thread id: value}``; hot paths write out ``table.get(get_ident()) if table
    else None`` (``mine``)."""

    __slots__ = ()  # no instance dict: its methods are found on the class at once

    def __init__(self) -> None:
        super().__init__()
        _tables.append(self)

    def mine(self) -> T | None:
        """This thread's value, None if it has none."""
        return self.get(get_ident()) if self else None

    def set_mine(self, value: T | None) -> None:
        """Give this thread ``value`` (None: take its value away)."""
        if value is None:
            self.pop(get_ident(), None)
        else:
            self[get_ident()] = value


def _keep_the_forking_threads() -> None:
    me = get_ident()
    for table in _tables:
        mine = table.get(me)
        table.clear()
        if mine is not None:
            table[me] = mine


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_the_forking_threads)
