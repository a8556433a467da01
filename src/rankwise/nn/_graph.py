"""Which parameters can receive a gradient from this forward's outputs.

With ``find_unused_parameters=True`` a parameter that no output depends on will never
fire its gradient hook; waiting for it would stall its bucket until the end of backward.
Walking the autograd graph from the outputs (as torch DDP does) finds those parameters
before backward starts, so they can be marked ready at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch

__all__ = ["reachable_leaves", "tensors_in"]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors inside a forward's return value (nested containers, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from tensors_in(value)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from tensors_in(getattr(obj, f.name))


def reachable_leaves(outputs: Any) -> set[int]:
    """``id()`` of every leaf tensor whose gradient the outputs' graph accumulates."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    stack = []
    for t in tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves
