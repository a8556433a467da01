"""Run numpy arithmetic with its floating-point warnings off, for two contextvar calls.

Why: a reduction must let inf and nan through silently, as torch does, whatever
``np.seterr`` the user set (under "raise" an overflow would abort a collective half
done, on one rank). ``np.errstate`` builds its state object on every entry, about
1.5 us here: more than a small all_reduce's arithmetic. numpy 2 keeps that state in a
context variable, so this module builds the "ignore all" state once and sets it around
each call (about 0.3 us). Where that variable is missing or does not behave (numpy 1,
or a future numpy that moves it), ``np.errstate`` is used: the same result, slower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["call_quietly"]

T = TypeVar("T")


def _with_errstate(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    with np.errstate(all="ignore"):
        return fn(*args, **kwargs)


def _fast_path() -> Callable[..., Any] | None:
    """``call_quietly`` through numpy's context variable, if it provably works here."""
    try:
        from numpy._core.umath import _extobj_contextvar as var
        from numpy._core.umath import _make_extobj

        ignore = _make_extobj(all="ignore")
    except (ImportError, AttributeError, TypeError, ValueError):
        return None

    def quietly(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        token = var.set(ignore)
        try:
            return fn(*args, **kwargs)
        finally:
            var.reset(token)

    # prove it: under "raise", an overflow passes inside and raises again after
    big = np.array([3e38], np.float32)
    try:
        with np.errstate(all="raise"):
            quietly(np.add, big, big, out=np.empty_like(big))
            try:
                np.add(big, big)
            except FloatingPointError:
                return quietly
    except FloatingPointError:
        pass
    return None


#: ``call_quietly(fn, *args, **kwargs)``: ``fn(*args, **kwargs)`` with numpy's float warnings and errors off
call_quietly: Callable[..., Any] = _fast_path() or _with_errstate
