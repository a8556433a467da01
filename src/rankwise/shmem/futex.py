"""Futex wait/wake and a store-load fence, from Python, for waits on shared memory.

Why futexes: a waiting rank must sleep in the kernel (4 ranks on 2 cores cannot afford
spinning) yet wake within microseconds when a peer publishes. A futex on a word in the
shared segment does both, across processes (no ``FUTEX_PRIVATE_FLAG``: the mapping is
shared). ``syscall`` is called through ctypes, which releases the GIL while we sleep.

Why a fence: "set my sleeping flag, then re-read the sequence numbers" (waiter) and
"store my sequence number, then read the peers' sleeping flags" (publisher) is Dekker's
pattern; x86 TSO may let each load pass the preceding store, and both sides would then
miss each other (the waiter would sleep until its futex timeout). A locked instruction
between the store and the load forbids that. Python has no fence primitive, but an
uncontended ``threading.Lock`` acquire/release is ``sem_trywait``/``sem_post`` in glibc,
i.e. ``lock cmpxchg``/``lock xadd``: a full barrier on x86 for ~100 ns.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

__all__ = ["fence", "futex_wait", "futex_wake", "supported"]

_SYS_FUTEX = 202  #: x86_64 only; the segment refuses other machines anyway (ordering)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """True where the raw syscall number and TSO ordering we rely on hold."""
    return platform.machine() in ("x86_64", "AMD64") and os.name == "posix"


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns on a wake, a timeout, a signal, or when the word already differs (EAGAIN):
    callers re-check their condition in a loop, so the reason does not matter.
    """
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_int32(expected).value,
             ctypes.byref(ts), None, 0)


def futex_wake(addr: int, count: int = 1 << 30) -> None:
    """Wake up to ``count`` processes sleeping on the int32 at ``addr``."""
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, count, None, None, 0)


_fence_lock = threading.Lock()


def fence() -> None:
    """Full memory barrier (see the module docstring for why a lock does it)."""
    _fence_lock.acquire()
    _fence_lock.release()
