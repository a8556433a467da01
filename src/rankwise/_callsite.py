"""Where in the user's code a rankwise call was made.

Why: an error that says "collective #7 mismatched" helps nobody; one that says
"rank 0 called barrier() at train.py:41 in create_dataloader, rank 1 at train.py:88"
points at the bug. Each call records the first frames outside rankwise (file, line,
function, and a few callers). The result is cached per code location, so the hot path
costs a frame walk and a dict lookup, and only a 32-bit id travels on the wire (the
text is sent once per connection, see ``Kind.SITE``).
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from types import FrameType

__all__ = ["CallSite", "capture", "enabled", "set_enabled", "site_text", "skip_directory"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: frames of the standard library's context-manager plumbing are skipped too: a barrier
#: made inside ``@contextmanager`` code should point at the user's ``with`` line, not at
#: ``contextlib.py:144 in __exit__``
_SKIP_FILES = (os.sep + "contextlib.py",)
_DEPTH = 4  #: user frames kept: the call and up to three callers
#: directories whose frames are never the user's: rankwise itself, plus what
#: :func:`skip_directory` adds (``rankwise.torch`` adds torch's, so a call that comes through
#: ``torch.distributed`` points at the user's line, not at ``distributed_c10d.py``)
_skip_dirs: tuple[str, ...] = (_PACKAGE_DIR,)

#: RANKWISE_DIAGNOSIS=0 turns call-site capture off (every call gets UNKNOWN): the switch
#: that ``benchmarks/diagnosis.py`` flips to measure what diagnosis costs
_enabled = os.environ.get("RANKWISE_DIAGNOSIS", "1").strip().lower() not in ("0", "false",
                                                                            "no", "off")


def enabled() -> bool:
    """Whether call sites (and with them history sites and traces) are recorded."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn call-site capture on or off at run time (all ranks should agree)."""
    global _enabled
    _enabled = bool(on)


@dataclass(frozen=True, slots=True)
class CallSite:
    id: int
    frames: tuple[tuple[str, int, str], ...]  #: (file, line, function), innermost first

    @property
    def short(self) -> str:
        """``train.py:41 in create_dataloader``."""
        if not self.frames:
            return "<unknown>"
        f, line, fn = self.frames[0]
        return f"{os.path.basename(f)}:{line} in {fn}"

    @property
    def chain(self) -> str:
        """``train.py:41 in create_dataloader <- train.py:90 in main``."""
        return " <- ".join(f"{os.path.basename(f)}:{ln} in {fn}" for f, ln, fn in self.frames)

    def encode(self) -> str:
        return "\n".join(f"{f}\t{ln}\t{fn}" for f, ln, fn in self.frames)

    @staticmethod
    def decode(site_id: int, text: str) -> CallSite:
        frames = []
        for line in text.splitlines()[:_DEPTH]:
            parts = line.split("\t")
            if len(parts) == 3 and parts[1].isdigit():
                frames.append((parts[0][:4096], int(parts[1]), parts[2][:256]))
        return CallSite(site_id, tuple(frames))


UNKNOWN = CallSite(0, ())
_cache: dict[tuple[int, ...], CallSite] = {}
_by_id: dict[int, CallSite] = {0: UNKNOWN}


_internal: dict[str, bool] = {}


def _classify(filename: str) -> bool:
    # sys.path may hold non-normalized paths ("bench/../src")
    path = os.path.abspath(filename)
    known = _internal[filename] = path.startswith(_skip_dirs) or path.endswith(_SKIP_FILES)
    return known


def skip_directory(path: str) -> None:
    """Treat every frame under ``path`` as library code, not the user's.

    Forgets what was classified and cached so far (a frame of ``path`` may have been
    taken for the user's already)."""
    global _skip_dirs
    prefix = os.path.join(os.path.abspath(path), "")
    if prefix not in _skip_dirs:
        _skip_dirs = (*_skip_dirs, prefix)
        _internal.clear()
        _cache.clear()


def _is_internal(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    known = _internal.get(name)
    return _classify(name) if known is None else known


def capture() -> CallSite:
    """The call site of the innermost frame outside the rankwise package, with up to
    three user callers (frames of rankwise and contextlib are skipped everywhere).

    Hot path (every collective): one walk with inlined lookups; the frames' text is
    only built the first time a (code, line) chain is seen.
    """
    if not _enabled:
        return UNKNOWN
    frame: FrameType | None = sys._getframe(1)
    internal = _internal
    # keyed by id(code), not the code object: hashing a code object hashes its bytecode
    # and constants, on every call. Safe because the cache keeps the code objects alive
    # (their ids cannot be reused while the entry exists).
    key: list[int] = []
    user: list[FrameType] = []
    while frame is not None:
        code = frame.f_code
        known = internal.get(code.co_filename)
        if known is None:
            known = _classify(code.co_filename)
        if not known:
            key.append(id(code))
            key.append(frame.f_lineno)
            user.append(frame)
            if len(user) == _DEPTH:
                break
        frame = frame.f_back
    if not user:
        return UNKNOWN
    tkey = tuple(key)
    site = _cache.get(tkey)
    if site is None:
        site = _build(tkey, user)
    return site


_alive: list[object] = []  #: code objects whose ids are cache keys


def _build(tkey: tuple[int, ...], user: list[FrameType]) -> CallSite:
    frames = [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in user]
    text = "\n".join(f"{f}\t{ln}\t{fn}" for f, ln, fn in frames)
    site = CallSite(zlib.crc32(text.encode()) or 1, tuple(frames))
    if len(_cache) < 65536:
        _alive.extend(f.f_code for f in user)
        _cache[tkey] = site
    _by_id[site.id] = site
    return site


def site_text(site_id: int) -> CallSite:
    """This process's own call site for ``site_id`` (UNKNOWN if never seen)."""
    return _by_id.get(site_id, UNKNOWN)
