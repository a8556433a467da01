"""Where in the user's code a rankwise call was made.

Why: an error that says "collective #7 mismatched" helps nobody; one that says
"rank 0 called barrier() at train.py:41 in create_dataloader, rank 1 at train.py:88"
points at the bug. Each call records the first frames outside rankwise (file, line,
function, and a few callers); library frames (torch, site-packages, the standard
library) on the way to the user's code are kept as "via", never shown first. The result
is cached per code location, so the hot path costs a frame walk and a dict lookup, and only a
32-bit id travels on the wire (the text is sent once per connection, see ``Kind.SITE``).
The walk keys each frame by its instruction offset (``f_lasti``), never by its line:
``f_lineno`` scans the code's line table from the start (4 us for a frame near the end of
a 300-line ``main``, per frame, per call); lines are looked up only when a new chain is
seen and its text is built. The walk and the lookup of a chain seen before also exist in
C (``rankwise/_native.c``, built by ``pip install`` where a compiler is found: ~0.3 us instead of
~2 us for a stack of 8-10 frames); without it the Python walk serves alone, with the same
results.
"""

from __future__ import annotations

import itertools
import linecache
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from types import FrameType

from .. import settings

__all__ = ["CallSite", "calling", "capture", "enabled", "is_library", "set_enabled", "site_text",
           "skip_directory", "stack_of"]

#: rankwise's own frames: everything under the package root (this file is one level down)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: frames of the standard library's context-manager plumbing are skipped too: a barrier
#: made inside ``@contextmanager`` code should point at the user's ``with`` line, not at
#: ``contextlib.py:144 in __exit__``
_SKIP_FILES = (os.sep + "contextlib.py",)
_DEPTH = 4  #: user frames kept: the call and up to three callers
#: library frames kept between the call and the user's code: a DDP gradient all_reduce is
#: made from torch's autograd engine, and "via graph.py:979 in _engine_run_backward" says
#: how the user's ``loss.backward()`` line got there
_VIA = 3
_USER, _LIBRARY, _SKIP = 0, 1, 2  #: kinds of frames (see ``_classify``)
#: where library code lives: installed packages (torch, numpy, ...) and the standard library
_LIBRARY_MARKS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(d) + os.sep for d in (
    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")) if d}))
#: directories whose frames are never shown, not even as "via": rankwise itself, plus what
#: :func:`skip_directory` adds (``rankwise.torch`` adds torch's, so a call that comes through
#: ``torch.distributed`` points at the user's line, not at ``distributed_c10d.py``)
_skip_dirs: tuple[str, ...] = (_PACKAGE_DIR,)

#: RANKWISE_DIAGNOSIS=0 turns call-site capture off (every call gets UNKNOWN): the switch
#: that ``benchmarks/diagnosis.py`` flips to measure what diagnosis costs
_enabled = settings.flag("RANKWISE_DIAGNOSIS")


def enabled() -> bool:
    """Whether call sites (and with them history sites and traces) are recorded."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn call-site capture on or off at run time (all ranks should agree)."""
    global _enabled
    _enabled = bool(on)


def is_library(path: str) -> bool:
    """Whether ``path`` is library code (an installed package, the standard library,
    torch wherever it lives), not the user's: the user's line is the one to show first."""
    path = os.path.abspath(path)
    if path.startswith("<frozen") or any(m in path for m in _LIBRARY_MARKS):
        return True
    if path.startswith(_LIBRARY_DIRS):
        return True
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    return isinstance(torch_file, str) and path.startswith(os.path.dirname(torch_file) + os.sep)


def _where(frame: tuple[str, int, str]) -> str:
    f, line, fn = frame
    return f"{os.path.basename(f)}:{line} in {fn}"


@dataclass(frozen=True, slots=True)
class CallSite:
    """Where a call was made: up to ``_VIA`` library frames the call went through, then
    up to ``_DEPTH`` frames of the user's code (innermost first)."""

    id: int
    frames: tuple[tuple[str, int, str], ...]  #: (file, line, function), innermost first

    def _split(self) -> tuple[tuple[tuple[str, int, str], ...], tuple[tuple[str, int, str], ...]]:
        """(library frames, user frames); all library when no user frame was found."""
        for i, (f, _, _) in enumerate(self.frames):
            if not is_library(f):
                return self.frames[:i], self.frames[i:]
        return (), self.frames

    @property
    def first(self) -> tuple[str, int, str] | None:
        """The innermost frame of the user's code (of a library when there is none)."""
        return self._split()[1][0] if self.frames else None

    @property
    def short(self) -> str:
        """``train.py:41 in create_dataloader``: the innermost frame of the user's code."""
        first = self.first
        return "<unknown>" if first is None else _where(first)

    @property
    def chain(self) -> str:
        """``train.py:41 in step <- train.py:90 in main (via _tensor.py:626 in backward ->
        graph.py:979 in _engine_run_backward)``: the user's frames, innermost first, then
        the library frames the innermost one called, in call order."""
        via, user = self._split()
        text = " <- ".join(_where(f) for f in user)
        if via:
            text += " (via " + " -> ".join(_where(f) for f in reversed(via)) + ")"
        return text

    def encode(self) -> str:
        return "\n".join(f"{f}\t{ln}\t{fn}" for f, ln, fn in self.frames)

    @staticmethod
    def decode(site_id: int, text: str) -> CallSite:
        frames = []
        for line in text.splitlines()[:_DEPTH + _VIA]:
            parts = line.split("\t")
            if len(parts) == 3 and parts[1].isdigit():
                frames.append((parts[0][:4096], int(parts[1]), parts[2][:256]))
        return CallSite(site_id, tuple(frames))


UNKNOWN = CallSite(0, ())
_cache: dict[tuple[int, ...], CallSite] = {}
_by_id: dict[int, CallSite] = {0: UNKNOWN}


_kinds: dict[str, int] = {}  #: frame kind by code file name (see ``_classify``)


def _classify(filename: str) -> int:
    # sys.path may hold non-normalized paths ("bench/../src")
    path = os.path.abspath(filename)
    if path.startswith(_skip_dirs) or path.endswith(_SKIP_FILES):
        kind = _SKIP
    else:
        kind = _LIBRARY if is_library(filename) else _USER
    _kinds[filename] = kind
    return kind


def skip_directory(path: str) -> None:
    """Treat every frame under ``path`` as rankwise's own: skipped, never shown.

    Forgets what was classified and cached so far (a frame of ``path`` may have been
    taken for a library's or the user's already)."""
    global _skip_dirs
    prefix = os.path.join(os.path.abspath(path), "")
    if prefix not in _skip_dirs:
        _skip_dirs = (*_skip_dirs, prefix)
        forget()


def forget() -> None:
    """Forget every file's kind and every cached chain (the C walk's memo too)."""
    _kinds.clear()
    _cache.clear()
    if _clear is not None:
        _clear()


def _walk(frame: FrameType | None) -> tuple[list[int], list[FrameType]]:
    """The frames a call site keeps, walking out from ``frame``: rankwise's own skipped,
    library frames kept only before the first user frame (at most ``_VIA``), user frames
    up to ``_DEPTH``; and the cache key of that chain (code ids and instruction offsets:
    each offset is on exactly one line, so the key names the lines without computing them).

    Hot path (every collective): inlined lookups, no text built here.
    """
    kinds = _kinds
    # keyed by id(code), not the code object: hashing a code object hashes its bytecode
    # and constants, on every call. Safe because the cache keeps the code objects alive
    # (their ids cannot be reused while the entry exists).
    key: list[int] = []
    kept: list[FrameType] = []
    users = via = 0
    depth, most_via = _DEPTH, _VIA  # locals: a global lookup per frame shows here
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code.co_filename)
        if kind is None:
            kind = _classify(code.co_filename)
        if not kind:  # _USER
            key.append(id(code))
            key.append(frame.f_lasti)
            kept.append(frame)
            users += 1
            if users == depth:
                break
        elif kind == 1 and not users and via < most_via:  # _LIBRARY, before the user's
            key.append(id(code))
            key.append(frame.f_lasti)
            kept.append(frame)
            via += 1
        frame = frame.f_back
    return key, kept


def capture(skip: int = 1) -> CallSite:
    """The call site of the innermost frame outside the rankwise package (see ``_walk``);
    the frames' text is only built the first time a (code, line) chain is seen.

    ``skip``: frames known to be rankwise's own, above this one (1: the caller). The walk
    skips rankwise's frames anyway; skipping them here spares making a frame object for
    each (the API's ``launch`` and the public function that called it: two per call)."""
    if not _enabled:
        return UNKNOWN
    frame = sys._getframe(skip)
    if _lookup is not None:  # the C walk: a chain seen before, or None
        site: CallSite | None = _lookup(frame, _kinds, _cache, _DEPTH, _VIA, UNKNOWN)
        if site is not None:
            return site
    key, kept = _walk(frame)
    if not kept:
        return UNKNOWN
    tkey = tuple(key)
    site = _cache.get(tkey)
    if site is None:
        site = _build(tkey, kept)
    return site


try:  # the same walk and cache lookup in C (``rankwise/_native.c``), when it was built
    from .._native import clear as _clear
    from .._native import lookup as _lookup
except ImportError:  # no compiler at install time: the Python walk alone
    _lookup = None  # type: ignore[assignment]
    _clear = None  # type: ignore[assignment]


_alive: list[object] = []  #: code objects whose ids are cache keys


def _frames_of(kept: list[FrameType]) -> tuple[tuple[str, int, str], ...]:
    return tuple((f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in kept)


def _build(tkey: tuple[int, ...], kept: list[FrameType]) -> CallSite:
    frames = _frames_of(kept)
    text = "\n".join(f"{f}\t{ln}\t{fn}" for f, ln, fn in frames)
    site = CallSite(zlib.crc32(text.encode()) or 1, frames)
    if len(_cache) < 65536:
        _alive.extend(f.f_code for f in kept)
        _cache[tkey] = site
    _by_id[site.id] = site
    return site


def stack_of(frame: FrameType | None) -> tuple[CallSite, str]:
    """Where a thread is now, from its innermost frame, and what the user's innermost
    frame is calling (``time.sleep``, ``loader.next``: see ``calling``; the library
    frames under it are in the site's "via"). Slow path: a who-is-where answer reads
    the user's thread with ``sys._current_frames``; nothing is cached."""
    kept = _walk(frame)[1]
    if not kept:
        return UNKNOWN, ""
    user = next((f for f in kept if not _kinds.get(f.f_code.co_filename)), kept[0])
    return CallSite(0, _frames_of(kept)), calling(user)


def calling(frame: FrameType | None) -> str:
    """What ``frame`` is calling now, as its source spells it (``time.sleep``), or "".

    From the current instruction's source span (Python 3.11+ positions): a thread
    blocked in C code (a sleep, a lock, a socket) has no frame of its own, and the
    callee is what tells "sleeping" from "waiting for a data loader"."""
    if frame is None:
        return ""
    try:
        positions = frame.f_code.co_positions()  # type: ignore[attr-defined]  # 3.11+
        pos = next(itertools.islice(positions, frame.f_lasti // 2, None), None)
        if pos is None or pos[0] is None or pos[2] is None:
            return ""
        line = linecache.getline(frame.f_code.co_filename, pos[0])
        end = pos[3] if pos[1] == pos[0] and pos[3] is not None else len(line)
        text = line[pos[2]:end]
    except (AttributeError, ValueError, TypeError):
        return ""
    head = text.split("(", 1)[0].strip()
    return head if "(" in text and head.replace(".", "").replace("_", "").isalnum() and \
        len(head) <= 80 else ""


def site_text(site_id: int) -> CallSite:
    """This process's own call site for ``site_id`` (UNKNOWN if never seen)."""
    return _by_id.get(site_id, UNKNOWN)
