from collections.abc import Callable
from typing import Any

def maker(cls: type, names: tuple[str, ...], defaults: tuple[Any, ...],
          required: object) -> Callable[..., Any]: ...
