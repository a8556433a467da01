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
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SLOW_MAX", "SLOW_MIN", "Copier", "address", "is_slow"]

Array = npt.NDArray[Any]

SLOW_MIN = 16 << 10  #: smaller copies are left alone: the slow path costs them < 5 us,
#: (it starts at 3 KiB) and checking costs ~1 us on every copy
SLOW_MAX = 512 << 10  #: from here on glibc copies with non-temporal stores instead
_PAGE = 4096
_NEAR = 32  #: destination this many bytes or fewer past the source: slow
_PIECE = 64 << 10  #: the bounce buffer: pieces that stay in the L2 cache

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


class Copier:
    """``copy(dst, src)``: ``dst[...] = src`` (same byte size, both contiguous), through
    the bounce buffer when a direct copy would be slow. One per group: the buffer is
    reused, and a group runs one call at a time."""

    def __init__(self) -> None:
        self._bounce = np.empty(_PIECE + _PAGE, np.uint8)
        self._at = address(self._bounce)

    def copy(self, dst: Array, src: Array) -> None:
        if SLOW_MIN <= dst.nbytes < SLOW_MAX:
            self.copy_at(dst, address(dst), src, address(src))
        else:
            dst[...] = src

    def copy_to(self, dst: Array, dst_at: int, src: Array) -> None:
        """``copy`` where the caller knows ``dst``'s address (a slot's, kept)."""
        if SLOW_MIN <= dst.nbytes < SLOW_MAX:
            self.copy_at(dst, dst_at, src, address(src))
        else:
            dst[...] = src

    def copy_at(self, dst: Array, dst_at: int, src: Array, src_at: int) -> None:
        """``copy`` where the caller knows both addresses."""
        if is_slow(dst_at, src_at, dst.nbytes):
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
