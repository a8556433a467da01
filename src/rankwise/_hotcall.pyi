from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

class WorkWait:
    def __init__(self, order_failed: Callable[[Any, BaseException], BaseException],
                 pending_type: type) -> None: ...
    def __call__(self, call: Any, p: Any) -> None: ...

class Enqueue:
    def __init__(self, allreduce: Callable[..., Any], tensors: list[Any], opts: Any,
                 watchdog: Any, check: Any, name: str, clock: Callable[[], float],
                 monotonic: bool, ordered: bool, append: Callable[[Any], None],
                 new_pending: Callable[..., Any], holders: dict[int, Any],
                 order: Callable[[Any, Any], None], after: Callable[[], None],
                 call_type: type, grace: float) -> None: ...
    def __call__(self, call: Any, then: bool) -> Any: ...

class AllReduce:
    def __init__(self, group: Any, comm: Any, router: Any, calls: Any, idle: Any,
                 history_append: Callable[[Any], None], fp: Any, dtype: Any, rop: Any,
                 shape: Any, label_var: ContextVar[Any], new_call: Callable[..., Any],
                 enqueue: Callable[[Any, bool], Any], failed: Callable[..., Any],
                 ended: Callable[..., Any], register_call: Callable[..., Any] | None,
                 gid: int, call_type: type) -> None: ...
    def __call__(self, site: Any, async_op: bool, tensor: Any) -> Any: ...

class Front:
    def __init__(self, entries: dict[int, Any], tensor_type: type, rop_type: type,
                 plan_type: type, world_globals: dict[str, Any], thread_worlds: dict[int, Any],
                 profiling_globals: dict[str, Any], capture: Callable[[int], Any]) -> None: ...
    def __call__(self, tensor: Any, op: Any, group: Any, async_op: bool) -> Any: ...
