"""Copies between user buffers and slots that dodge a 10x slow path of ``memcpy``.

Measured on this machine (AMD EPYC with FSRM, glibc 2.36): a copy of 3 KiB to 512 KiB
runs 10-12x slower when the destination starts 1 to 31 bytes past the source modulo
4096 (128 KiB: 48 us instead of 5; 500 KB: 204 us instead of 18). glibc copies that
range with ``rep movsb``, and the CPU then takes every store to alias a load of the
same page offset ("4K aliasing"). Outside that range of sizes, or at any other
distance, the same copy runs at full speed; numpy's arithmetic (which does not call
``memcpy``) is not affected.

Slots start at multiples of 64 bytes, so only a user buffer that is not 32-byte
aligned can meet that distance: numpy's large arrays often start 16 bytes past a page,
and any tensor view at an odd element offset can. A copy that would meet it goes
through a private bounce buffer placed half a page away from both ends: two fast
copies instead of one slow one (128 KiB: 11 us).

Not every CPU has that slow path, and where it is absent the bounce is what costs: on
another AMD EPYC (1 MiB L2 per core, same glibc) the same copies run at full speed at
every distance (128 KiB 16 bytes off: 1.6 us direct, 4.7 us bounced). So each process
measures once, on the first ``Copier``, whether a copy 16 bytes off a page is much
slower than one 64 bytes off (``slow_path_here``: ~0.05-0.3 ms), and bounces only then.
"""

from __future__ import annotations

import ctypes
import math
import time
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SLOW_MAX", "SLOW_MIN", "Copier", "address", "is_slow", "slow_path_here"]

Array = npt.NDArray[Any]

SLOW_MIN = 16 << 10  #: smaller copies are left alone: the slow path costs them < 5 us,
#: (it starts at 3 KiB) and checking costs ~1 us on every copy
SLOW_MAX = 512 << 10  #: from here on glibc copies with non-temporal stores instead
_PAGE = 4096
_NEAR = 32  #: destination this many bytes or fewer past the source: slow
_PIECE = 64 << 10  #: the bounce buffer: pieces that stay in the L2 cache
#: the slow path costs 10-12x where it exists; a machine without it measured 1.0-1.3x
_SLOW_RATIO = 3.0

_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def address(a: Array) -> int:
    """Where ``a``'s first byte lives (``a`` contiguous and non-empty)."""
    try:
        return _addressof(_from_buffer(a))  # type: ignore[arg-type]  # ~0.7 us (ctypes.data 1.5)
    except TypeError:  # read-only: ctypes needs a writable buffer
        return int(a.ctypes.data)


def is_slow(dst_address: int, src_address: int, nbytes: int) -> bool:
    """Whether ``memcpy(dst, src, nbytes)`` takes the slow path described above."""
    return SLOW_MIN <= nbytes < SLOW_MAX and 0 < (dst_address - src_address) % _PAGE < _NEAR


_measured: bool | None = None


def slow_path_here() -> bool:
    """Whether this machine's ``memcpy`` has the slow path (measured once per process).

    Times a 128 KiB copy whose destination is 16 bytes past the source modulo a page
    against one 64 bytes past, alternating, best of five each (a preemption lands on
    one sample, not on the verdict)."""
    global _measured
    if _measured is None:
        nbytes = 128 << 10
        buf = np.ones(2 * nbytes + 3 * _PAGE, np.uint8)  # written: its pages are mapped
        skip = (-address(buf)) % _PAGE
        src = buf[skip:skip + nbytes]
        dst0 = skip + nbytes + _PAGE
        near, far = (buf[dst0 + d:dst0 + d + nbytes] for d in (16, 64))
        best = {16: math.inf, 64: math.inf}
        for _ in range(5):
            for d, dst in ((16, near), (64, far)):
                t0 = time.perf_counter()
                dst[...] = src
                best[d] = min(best[d], time.perf_counter() - t0)
        _measured = best[16] > _SLOW_RATIO * best[64]
    return _measured


class Copier:
    """``copy(dst, src)``: ``dst[...] = src`` (same byte size, both contiguous), through
    the bounce buffer when a direct copy would be slow. One per group: the buffer is
    reused, and a group runs one call at a time.

    ``bounce``: whether to dodge the slow path at all; ``None`` asks this machine
    (``slow_path_here``)."""

    def __init__(self, bounce: bool | None = None) -> None:
        self.bounces = slow_path_here() if bounce is None else bounce
        #: the smallest copy that may bounce (none at all where there is no slow path)
        self._min = SLOW_MIN if self.bounces else SLOW_MAX
        self._bounce = np.empty(_PIECE + _PAGE, np.uint8)
        self._at = address(self._bounce)

    def copy(self, dst: Array, src: Array) -> None:
        if self._min <= dst.nbytes < SLOW_MAX:
            self.copy_at(dst, address(dst), src, address(src))
        else:
            dst[...] = src

    def copy_to(self, dst: Array, dst_at: int, src: Array) -> None:
        """``copy`` where the caller knows ``dst``'s address (a slot's, kept)."""
        if self._min <= dst.nbytes < SLOW_MAX:
            self.copy_at(dst, dst_at, src, address(src))
        else:
            dst[...] = src

    def copy_at(self, dst: Array, dst_at: int, src: Array, src_at: int) -> None:
        """``copy`` where the caller knows both addresses."""
        if self.bounces and is_slow(dst_at, src_at, dst.nbytes):
            self.bounce(dst, src, src_at)
        else:
            dst[...] = src

    def bounce(self, dst: Array, src: Array, src_at: int) -> None:
        """Copy through the bounce buffer, which starts half a page from ``src`` (modulo
        4096), so its distance from ``dst`` is half a page plus the slow 1-31 bytes."""
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        start = (src_at + _PAGE // 2 - self._at) % _PAGE
        for lo in range(0, d.size, _PIECE):
            piece = s[lo:lo + _PIECE]
            b = self._bounce[start:start + piece.size]
            b[...] = piece
            d[lo:lo + piece.size] = b
