"""Large communication buffers on 2 MiB pages (Linux transparent huge pages).

Why: every byte that moves between ranks on one machine is copied by the kernel twice,
into the sending socket and out of the receiving one, and with 4 KiB pages those copies
pay for a page-table walk every 4 KiB. Measured on the 2-core machine, 4 ranks, the same
buffer all-reduced repeatedly, same run: 16 MiB took 48.4 ms on 4 KiB pages and 42.5 ms
on huge pages (gloo on the same two buffers: 51.1 and 47.7 ms).

numpy already asks the kernel for huge pages for its arrays of 4 MiB and more; torch's
CPU allocator does not. So:

- ``empty`` allocates rankwise's own large buffers (scratch, DDP buckets) 2 MiB-aligned
  and marked for huge pages before their first touch: nothing to convert later.
- ``advise`` is called with every large buffer a call communicates. The second time
  the same buffer (address and size) comes by, it is marked for huge pages and
  collapsed into them (``MADV_COLLAPSE``, Linux >= 6.1; older kernels leave it to the
  background ``khugepaged``). Only whole 2 MiB pages inside the buffer are touched, so
  no memory outside it changes and none is added. The contents never change. The cost,
  paid once and only by buffers that are reused (as training loops reuse theirs), is
  5 ms per 16 MiB when the kernel has free huge pages and up to ~100 ms when it must
  compact memory first (measured here).

``RANKWISE_HUGEPAGES=0`` turns both off; so does a kernel with huge pages set to "never".
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import settings

__all__ = ["MIN_BYTES", "PAGE", "advise", "empty", "enabled"]

PAGE = 2 << 20  #: the huge page size on x86-64 and arm64 (4 KiB base pages)
MIN_BYTES = 4 << 20  #: smaller buffers are left alone (numpy's threshold too)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_SEEN_MAX = 4096  #: buffers remembered; the table starts over when full

_lock = threading.Lock()
_seen: dict[tuple[int, int], bool] = {}  #: inner page range -> already collapsed
_madvise: Callable[[int, int, int], int] | None = None
_checked = False


def enabled() -> bool:
    """Whether this process may ask for huge pages (Linux, THP not "never", not opted out)."""
    return _get_madvise() is not None


def _get_madvise() -> Callable[[int, int, int], int] | None:
    global _madvise, _checked
    if _checked:
        return _madvise
    with _lock:
        if not _checked:
            _madvise = _load()
            _checked = True
    return _madvise


def _load() -> Callable[[int, int, int], int] | None:
    if not settings.flag("RANKWISE_HUGEPAGES"):
        return None
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _inner_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole huge pages inside [address, address + nbytes), as (start, end)."""
    start = (address + PAGE - 1) & ~(PAGE - 1)
    end = (address + nbytes) & ~(PAGE - 1)
    return start, max(start, end)


def advise(array: npt.NDArray[Any]) -> bool:
    """Note that ``array`` (contiguous) is being communicated; on its second appearance,
    move its whole 2 MiB pages onto huge pages. True when that happened just now. Never
    fails: a kernel that refuses leaves the buffer as it was."""
    if array.nbytes < MIN_BYTES:
        return False
    madvise = _get_madvise()
    if madvise is None:
        return False
    key = _inner_pages(array.__array_interface__["data"][0], array.nbytes)
    if key[0] == key[1]:
        return False
    with _lock:
        done = _seen.get(key)
        if done:
            return False
        if done is None:  # first sighting: a one-off buffer is not worth converting
            if len(_seen) >= _SEEN_MAX:
                _seen.clear()
            _seen[key] = False
            return False
        _seen[key] = True
    length = key[1] - key[0]
    return madvise(key[0], length, _MADV_HUGEPAGE) == 0 and \
        madvise(key[0], length, _MADV_COLLAPSE) == 0


def empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """An uninitialized byte buffer; from MIN_BYTES on, 2 MiB-aligned, in a fresh private
    mapping marked for huge pages before anything touches it (its first writes fault in
    huge pages; heap memory recycled by malloc could already sit on small ones)."""
    madvise = _get_madvise() if nbytes >= MIN_BYTES else None
    if madvise is None:
        return np.empty(nbytes, np.uint8)
    try:
        region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return np.empty(nbytes, np.uint8)
    raw = np.frombuffer(region, np.uint8)  # keeps ``region`` mapped while views live
    skip = -raw.__array_interface__["data"][0] % PAGE
    buf = raw[skip:skip + nbytes]
    start, end = _inner_pages(buf.__array_interface__["data"][0], nbytes)
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)
    return buf
