"""DDP communication hooks: ``register_comm_hook(state, hook)``, as in torch.

A hook replaces the reducer's own "pre-divide, then all_reduce" for every bucket:
the reducer hands it the bucket's raw summed-locally gradients as a
:class:`rankwise.GradBucket` and waits, at the end of backward, on the future it
returns; the future's value (a tensor, or a list holding one, which is what
``Work.get_future()`` gives) becomes the bucket's averaged gradients. Dividing by the
world size is the hook's job, exactly as with torch's ``allreduce_hook``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rankwise.api.grad_bucket import GradBucket
from rankwise.errors import InvalidArgument
from rankwise.nn._errors import DDPError

__all__ = ["CommHook", "HookedWork", "check_hook"]


@dataclass(frozen=True)
class CommHook:
    """A registered hook and the state it is called with."""

    hook: Callable[[Any, GradBucket], Any]
    state: Any

    def launch(self, bucket: GradBucket) -> HookedWork:
        """Run the hook on ``bucket``; what the reducer waits on at the end of backward."""
        target = bucket.buffer()
        future = self.hook(self.state, bucket)
        if not callable(getattr(future, "wait", None)):
            raise DDPError(
                f"communication hook {_name(self.hook)} returned {type(future).__name__}, "
                "not a future: return e.g. all_reduce(..., async_op=True).get_future() "
                "(or a torch.futures.Future)"
            )
        return HookedWork(self, bucket, target, future)


class HookedWork:
    """Stands where the reducer keeps a bucket's ``Work``: waiting copies the hook's
    result into the bucket's buffer (unless the hook reduced the buffer in place)."""

    def __init__(self, hook: CommHook, bucket: GradBucket, target: torch.Tensor,
                 future: Any) -> None:
        self._hook, self._bucket, self._target, self._future = hook, bucket, target, future

    def wait(self) -> bool:
        value = hook_result(self._future.wait(), self._bucket, self._hook)
        if value.data_ptr() != self._target.data_ptr():
            with torch.no_grad():
                self._target.copy_(value.view(self._target.shape))
        return True


def check_hook(hook: Any) -> None:
    """Refuse what cannot be a hook before any backward runs (torch checks the same)."""
    if not callable(hook):
        raise InvalidArgument(f"communication hook must be callable, got {type(hook).__name__}")
    try:
        parameters = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    positional = [
        p for p in parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in parameters.values())
    if len(positional) < 2 and not variadic:
        raise InvalidArgument(
            f"communication hook {_name(hook)} must take (state, bucket), "
            f"its signature is {inspect.signature(hook)}"
        )


def hook_result(value: Any, bucket: GradBucket, hook: CommHook) -> torch.Tensor:
    """The flat tensor a hook's future completed with, checked against its bucket."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    flat = bucket.buffer()
    if not isinstance(value, torch.Tensor) or value.numel() != flat.numel():
        got = (
            f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise DDPError(
            f"communication hook {_name(hook.hook)} completed bucket {bucket.index()} with "
            f"{got}; expected a tensor of {flat.numel()} elements (the bucket's buffer)"
        )
    return value


def _name(hook: Any) -> str:
    return str(getattr(hook, "__qualname__", None) or repr(hook))
