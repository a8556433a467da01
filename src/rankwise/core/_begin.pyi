from typing import Any

def begin(new_call: Any, label_var: Any, group: Any, fp: Any, site: Any, dtype: Any, op: Any,
          shape: tuple[int, ...] | None, frames: bool) -> Any: ...
