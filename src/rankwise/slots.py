"""Fast constructors for slots dataclasses that are made once per call on a hot path.

``fast_new(cls)`` returns a callable that makes ``cls(*values)`` without running the
dataclass's generated ``__init__``: it stores the values, then the fields' defaults, in
the instance's slots (``_native.c``: ~0.1 us instead of ~0.5 us for 11-19 fields). Only for
classes whose ``__init__`` does nothing else: a dataclass with ``slots=True``, no
``__post_init__``, no ``default_factory``, ``InitVar``, ``init=False`` or keyword-only
field; anything else, or
no C module (no compiler at install time), gets the class itself: the same objects.
Keyword calls go to the class itself too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["fast_new", "slot_maker"]

T = TypeVar("T")

try:
    from ._native import maker as _maker
except ImportError:  # no compiler at install time: the class's own __init__
    _maker = None  # type: ignore[assignment]

#: the default of a field that has none (never stored: the maker refuses fewer values)
_REQUIRED = object()


def fast_new(cls: Callable[..., T]) -> Callable[..., T]:
    """A constructor of the slots dataclass ``cls`` taking its fields' values in order,
    positionally (see the module's doc); ``cls`` itself where that cannot serve."""
    if _maker is None or not _plain(cls):
        return cls
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = tuple(f.name for f in fields)
    defaults = tuple(_REQUIRED if f.default is dataclasses.MISSING else f.default
                     for f in fields)
    made: Callable[..., T] = _maker(cls, names, defaults, _REQUIRED)  # type: ignore[arg-type]
    return made


def slot_maker(cls: Callable[..., T], names: tuple[str, ...],
               defaults: tuple[Any, ...] = ()) -> Callable[..., T]:
    """A constructor of the slots class ``cls`` (no ``__dict__``) that stores its
    positional values in the slots ``names``, in order (the last ``len(defaults)`` may
    be left out: those defaults), and runs no ``__init__``: for a class whose
    ``__init__`` does more than a hot path needs (``core.work``'s ended ``Work``). In
    Python where the C module was not built: the same objects, slower."""
    full = (_REQUIRED,) * (len(names) - len(defaults)) + tuple(defaults)
    if _maker is not None:
        made: Callable[..., T] = _maker(cls, names, full, _REQUIRED)  # type: ignore[arg-type]
        return made
    least = len(names) - len(defaults)
    new = object.__new__

    def make(*values: Any) -> T:
        if not least <= len(values) <= len(names):
            raise TypeError(f"{getattr(cls, '__name__', cls)} takes {least} to {len(names)} "
                            f"values, got {len(values)}")
        obj: T = new(cls)
        for name, value in zip(names, values + full[len(values):], strict=True):
            setattr(obj, name, value)
        return obj

    return make


def _plain(cls: Any) -> bool:
    """Its generated ``__init__`` stores each field's value or default, and nothing else:
    its parameters are the fields, in order, each positional (no ``InitVar``, no
    ``init=False`` or keyword-only field), none made by a ``default_factory``."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)) \
            or "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        return False
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p.name for p in params] == [f.name for f in fields] \
        and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params) \
        and all(f.default_factory is dataclasses.MISSING for f in fields)
