"""Creating and attaching one group's shared segment, with rendezvous through a store.

Why memfd first: a ``memfd_create`` file has no name, so nothing can leak into
``/dev/shm`` whatever happens to the processes (SIGKILL included); the kernel frees it
when the last mapping and descriptor go. Peers reach it by opening
``/proc/<pid>/fd/<fd>`` of rank 0 (same host, same user). Where that open is refused
(another user, a hardened ``ptrace_scope``, separate PID namespaces), the fallback is a
file in ``/dev/shm`` created with ``O_EXCL`` under a random name and unlinked as soon as
every peer has mapped it: by rank 0 after every peer acknowledged, and also by the last
peer to map it (so a rank 0 killed in between leaks nothing). Files whose creator died
before that point carry the creator's pid in their name; the next creation on the host
removes them.

Why ``posix_fallocate``: it reserves the pages now, so a too-small ``/dev/shm`` (Docker's
64 MB default) fails here with ENOSPC, not later with SIGBUS in the middle of a copy.

Never ``multiprocessing.shared_memory``: its resource tracker unlinks segments that live
peers still use.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ..errors import DistTimeout
from .errors import ShmUnavailable
from .layout import H_MAGIC, H_NRANKS, H_SLOT_BYTES, H_TOTAL, H_VERSION, SegmentLayout

__all__ = ["Segment", "StoreLike", "open_segment"]

SHM_DIR = "/dev/shm"
FILE_PREFIX = "rankwise-shm-"
MIN_SLOT = 65536

L = TypeVar("L", bound=SegmentLayout)


class StoreLike(Protocol):
    """The part of ``rankwise.store.Store`` the rendezvous uses."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def batch(self, ops: Sequence[tuple[Any, ...]]) -> list[Any]: ...
    def wait_get(self, key: str, timeout: float) -> bytes | None: ...
    def batch_then_wait_get(self, ops: Sequence[tuple[Any, ...]], key: str,
                            timeout: float) -> tuple[list[Any], bytes | None]: ...
    def batch_then_wait_read(self, ops: Sequence[tuple[Any, ...]], keys: Sequence[str],
                             timeout: float) -> tuple[list[Any], list[bytes] | None]: ...


@dataclass(slots=True)
class Segment(Generic[L]):
    """A mapped segment; ``method`` is "memfd" or "file" (how it was shared)."""

    mm: mmap.mmap
    layout: L
    method: str


def _words(mm: mmap.mmap) -> memoryview:
    return memoryview(mm).cast("B").cast("q")


def _sweep_orphans() -> None:
    """Unlink fallback files whose creator is gone.

    Two signs must agree: the pid in the name is not a live process here, and nobody
    holds the shared ``flock`` the creator keeps until it unlinks (locks die with their
    process, and unlike pids they are seen across PID namespaces that share /dev/shm).
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        pid_text = name[len(FILE_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except OSError:
            continue  # alive under another user (EPERM): not ours to judge
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _unlink(path)
        except OSError:
            pass  # still locked: its creator lives (in another PID namespace)
        finally:
            os.close(fd)


def _fit_slot(nranks: int, slot_bytes: int, method: str, kind: type[SegmentLayout]) -> int:
    """Shrink ``slot_bytes`` so a /dev/shm file fits in half the free space; raise when
    even the smallest slots do not fit."""
    if method != "file":
        return slot_bytes  # memfd pages are not charged to /dev/shm's size limit
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        raise ShmUnavailable(f"cannot inspect {SHM_DIR}: {exc}") from exc
    free = st.f_bavail * st.f_frsize
    if kind(nranks, slot_bytes).total <= free // 2:
        return slot_bytes
    fitted = kind.for_total(nranks, free // 2)
    if fitted < MIN_SLOT:
        raise ShmUnavailable(
            f"{SHM_DIR} has only {free >> 20} MiB free, too little for {nranks} ranks' "
            "shared-memory slots; give the container more (docker run --shm-size=1g)")
    return fitted


def _create_fd(kind: type[L], method: str, nranks: int,
               slot_bytes: int) -> tuple[int, str, L]:
    """A sized, zero-filled file for the segment: (fd, path or "", layout)."""
    slot_bytes = _fit_slot(nranks, slot_bytes, method, kind)
    layout = kind(nranks, slot_bytes)
    path = ""
    if method == "memfd":
        fd = os.memfd_create("rankwise-shm", os.MFD_CLOEXEC)
    else:
        _sweep_orphans()
        path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # "creator alive" for _sweep_orphans, until unlink
    try:
        os.posix_fallocate(fd, 0, layout.total)
    except OSError as exc:
        os.close(fd)
        if path:
            _unlink(path)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ShmUnavailable(
                f"no room for a {layout.total >> 20} MiB shared segment ({method}): {exc}; "
                "give the container more shared memory (docker run --shm-size=1g) or "
                "lower RANKWISE_SHM_SLOT_BYTES") from exc
        raise ShmUnavailable(f"cannot size the shared segment ({method}): {exc}") from exc
    return fd, path, layout


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _map(fd: int, total: int) -> mmap.mmap:
    return mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _attach(desc: str, nranks: int, kind: type[L]) -> tuple[mmap.mmap, L]:
    """Open and map what rank 0 described; check the header before trusting sizes."""
    how, _, where = desc.partition(" ")
    if how == "memfd":
        pid, fdno = where.split()
        path = f"/proc/{int(pid)}/fd/{int(fdno)}"
    elif how == "file" and where.startswith(SHM_DIR + "/" + FILE_PREFIX) and ".." not in where:
        path = where
    else:
        raise ShmUnavailable(f"unusable segment description {desc[:200]!r}")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < 4096:
            raise ShmUnavailable(f"segment {path} is only {size} bytes")
        head = _map(fd, 4096)
        try:
            w = _words(head)
            magic, version, n, slot, total = (w[H_MAGIC], w[H_VERSION], w[H_NRANKS],
                                              w[H_SLOT_BYTES], w[H_TOTAL])
            w.release()
        finally:
            head.close()
        layout = kind(nranks, slot)
        if (magic, version, n) != (kind.MAGIC, kind.VERSION, nranks) or slot <= 0 or slot % 64 \
                or total != layout.total or size < total:
            raise ShmUnavailable(
                f"segment {path} has a foreign header (magic {magic:#x}, version {version}, "
                f"{n} ranks, slot {slot}, total {total}, file {size} bytes)")
        return _map(fd, total), layout
    finally:
        os.close(fd)


def open_segment(store: StoreLike, prefix: str, rank: int, nranks: int, *,
                 slot_bytes: int, method: str, timeout: float,
                 kind: type[L]) -> Segment[L]:
    """Rendezvous on ``store`` under ``prefix`` and return this rank's mapping.

    ``method``: "auto" (memfd, else a /dev/shm file), "memfd" or "file". Rank 0 creates;
    each attempt ends with every peer acknowledging, so all ranks agree on the result.
    Raises ``ShmUnavailable`` (every rank) when no method works. ``kind``: the layout of
    what lives in the segment (the collective engine's by default).
    """
    methods = {"auto": ["memfd", "file"], "memfd": ["memfd"], "file": ["file"]}.get(method)
    if methods is None:
        raise ShmUnavailable(f"unknown shared-memory method {method!r} (auto, memfd, file)")
    if rank == 0:
        return _create(store, prefix, nranks, slot_bytes, methods, timeout, kind)
    return _join(store, prefix, rank, nranks, timeout, kind)


def _timed_out(timeout: float, what: str, key: str) -> DistTimeout:
    return DistTimeout(f"shared-memory setup: timed out after {timeout:g}s waiting for "
                       f"{what} (store key {key!r})")


def _wait_key(store: StoreLike, key: str, timeout: float, what: str) -> bytes:
    value = store.wait_get(key, timeout)  # the wait and the read: one round trip
    if value is None:
        raise _timed_out(timeout, what, key)
    return value


def _create(store: StoreLike, prefix: str, nranks: int, slot_bytes: int,
            methods: list[str], timeout: float, kind: type[L]) -> Segment[L]:
    deadline = time.monotonic() + timeout
    reasons: list[str] = []
    for attempt, method in enumerate(methods):
        last = attempt == len(methods) - 1
        try:
            fd, path, layout = _create_fd(kind, method, nranks, slot_bytes)
        except ShmUnavailable as exc:
            reasons.append(str(exc))
            if last:
                store.set(f"{prefix}/seg{attempt}", b"fail " + str(exc).encode())
                raise ShmUnavailable("; ".join(reasons)) from exc
            store.set(f"{prefix}/seg{attempt}", b"skip")
            continue
        mm: mmap.mmap | None = None
        try:
            mm = _map(fd, layout.total)
            w = _words(mm)
            w[H_MAGIC], w[H_VERSION], w[H_NRANKS] = kind.MAGIC, kind.VERSION, nranks
            w[H_SLOT_BYTES], w[H_TOTAL] = layout.slot_bytes, layout.total
            w.release()
            desc = f"memfd {os.getpid()} {fd}" if method == "memfd" else f"file {path}"
            acks = [f"{prefix}/ack{attempt}/{r}" for r in range(1, nranks)]
            # the description out and every peer's answer back: one round trip
            _, answers = store.batch_then_wait_read(
                [("set", f"{prefix}/seg{attempt}", desc.encode())], acks,
                max(0.0, deadline - time.monotonic()))
            if answers is None:
                raise DistTimeout(f"shared-memory setup: not every rank mapped the segment "
                                  f"within {timeout:g}s (store keys {acks})")
            failed = [a.decode("utf-8", "replace") for a in answers if a != b"ok"]
            if not failed:
                store.set(f"{prefix}/result{attempt}", b"ok")
                seg = Segment(mm, layout, method)
                mm = None
                return seg
            reasons.append(f"{method}: " + "; ".join(failed))
            if last:
                store.set(f"{prefix}/result{attempt}", b"fail")
                raise ShmUnavailable("peers could not map the shared segment: "
                                     + "; ".join(reasons))
            store.set(f"{prefix}/result{attempt}", b"retry")
        finally:
            if mm is not None:
                mm.close()
            os.close(fd)
            if path:
                _unlink(path)
    raise AssertionError("unreachable")


def _join(store: StoreLike, prefix: str, rank: int, nranks: int, timeout: float,
          kind: type[L]) -> Segment[L]:
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        left = max(0.0, deadline - time.monotonic())
        desc = _wait_key(store, f"{prefix}/seg{attempt}", left,
                         "rank 0 to create the segment").decode("utf-8", "replace")
        if desc.startswith("fail "):
            raise ShmUnavailable(desc[5:])
        if desc == "skip":
            attempt += 1
            continue
        mapping: tuple[mmap.mmap, L] | None = None
        try:
            mapping = _attach(desc, nranks, kind)
            ack = b"ok"
        except (OSError, ValueError, ShmUnavailable) as exc:
            ack = f"rank {rank} could not open {desc.split(' ', 1)[0]} segment: {exc}".encode()
        # the last peer to map a file unlinks it, in case rank 0 dies before it does
        if mapping is not None and desc.startswith("file ") \
                and store.add(f"{prefix}/mapped{attempt}", 1) == nranks - 1:
            _unlink(desc[5:])
        left = max(0.0, deadline - time.monotonic())
        verdict = f"{prefix}/result{attempt}"
        # the answer out and rank 0's verdict back: one round trip
        _, result = store.batch_then_wait_get([("set", f"{prefix}/ack{attempt}/{rank}", ack)],
                                              verdict, left)
        if result is None:
            if mapping is not None:
                mapping[0].close()
            raise _timed_out(left, "rank 0's verdict", verdict)
        if result == b"ok" and mapping is not None:
            return Segment(mapping[0], mapping[1], desc.split(" ", 1)[0])
        if mapping is not None:
            mapping[0].close()
        if result != b"retry":
            raise ShmUnavailable(f"the shared segment could not be set up on every rank "
                                 f"({ack.decode('utf-8', 'replace')})")
        attempt += 1
