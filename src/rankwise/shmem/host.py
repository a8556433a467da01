"""Which processes may share memory: the identity every rank publishes before any
shared-memory segment is opened (used by the shm engine and the shm transport alike)."""

from __future__ import annotations

import os
import platform
import socket

__all__ = ["host_identity"]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _inode(path: str) -> str:
    try:
        return str(os.stat(path).st_ino)
    except OSError:
        return "?"


def _shm_device() -> str:
    try:
        return str(os.stat("/dev/shm").st_dev)
    except OSError:
        return "none"


def host_identity() -> str:
    """What must be equal for two processes to share memory segments and see each
    other's pids: one kernel boot, one /dev/shm, one pid namespace, one architecture."""
    return "|".join((socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"),
                     _shm_device(), _inode("/proc/self/ns/pid"), platform.machine()))
