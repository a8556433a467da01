from types import FrameType

from .callsite import CallSite

def lookup(frame: FrameType, kinds: dict[str, int], cache: dict[tuple[int, ...], CallSite],
           depth: int, via: int, unknown: CallSite) -> CallSite | None: ...
def clear() -> None: ...
