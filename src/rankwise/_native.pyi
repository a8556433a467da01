from collections.abc import Callable
from types import FrameType
from typing import Any

from .identity.callsite import CallSite

def maker(cls: type, names: tuple[str, ...], defaults: tuple[Any, ...],
          required: object) -> Callable[..., Any]: ...
def lookup(frame: FrameType, kinds: dict[str, int], cache: dict[tuple[int, ...], CallSite],
           depth: int, via: int, unknown: CallSite) -> CallSite | None: ...
def clear() -> None: ...
