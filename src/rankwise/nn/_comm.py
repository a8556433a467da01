"""Where DDP and the sampler get their collectives from.

Everything in ``rankwise.nn`` and ``rankwise.utils.data`` talks to the process group
through :func:`comm` only, so the same code (and the same tests) can run on rankwise's
own core or, as an oracle, on ``torch.distributed`` with gloo: both expose the same
functions (``get_rank``, ``all_reduce(..., async_op=True)``, ``broadcast``,
``all_gather_object``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["comm", "use_comm"]

_override: ModuleType | None = None


def comm() -> Any:
    """Return the module whose collectives DDP uses (``rankwise`` unless overridden).

    Typed ``Any`` on purpose: rankwise and ``torch.distributed`` share the call
    signatures DDP uses but not a common static type.
    """
    if _override is not None:
        return _override
    return importlib.import_module("rankwise")


def use_comm(module: ModuleType | None) -> None:
    """Route DDP's collectives through ``module`` (e.g. ``torch.distributed``); ``None`` resets."""
    global _override
    _override = module
