"""Fingerprint checks on the control plane, for engines whose data rankwise does not own.

Why: where a foreign library moves the bytes (torch's gloo or NCCL), no rankwise header
rides with the data, so nothing compares the ranks' calls. Each rank instead sends each
call's fingerprint and call site to its ring neighbour (group rank + 1) as an empty
collective frame on rankwise's own TCP connections. Each rank equal to the previous one
proves all are equal, at one small frame per call and rank. The frame is a
``Kind.COLL`` frame on the ``CHECK`` lane (``wire.frames.Flag``), so the router checks it exactly as it checks the
message engine's frames: the same mismatch words (both calls with their file:line), the
same divergence report, the same abort of every rank.

``RANKWISE_CHECK``:
- ``async`` (default): send and go on; the neighbour's frame is matched whenever it
  comes. A mismatched call may start on the data plane, but the mismatch fails the
  group at once (the waiting ranks are released, see ``torch_wait``), and the data of
  a call that completed is not handed back once the mismatch is known. Except on first
  sight: the first call this rank makes with a given fingerprint at a given call site
  waits as in ``sync``. Why: gloo terminates the process (``EnforceNotMet``, SIGABRT)
  when more bytes arrive than its op expects, so a mismatched size must never reach
  it; a new call (a branch taken on some ranks only, a first step) is where mismatches
  live, while a training loop's repeated calls, once confirmed, run without waiting,
  and send their frame once the data op is enqueued (``flush``), overlapping it.
- ``sync``: wait for the neighbour's fingerprint before the data op starts, so no
  mismatched op ever runs: one control round trip per call.
- ``off``: no checks.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..core.router import Pending
from ..errors import DistError, InvalidArgument
from ..identity.calls import Fingerprint
from ..wire.frames import Flag, Kind, encode_header
from .base import Call

if TYPE_CHECKING:
    from ..core.group import ProcessGroup

__all__ = ["CHECK_ENV", "CHECK_MODES", "RingCheck", "check_mode"]

log = logging.getLogger("rankwise")

CHECK_ENV = "RANKWISE_CHECK"
CHECK_MODES = ("async", "sync", "off")
_NOTHING = memoryview(bytearray())
#: confirmed (fingerprint, call site) pairs remembered per group (``async`` first sight)
_SEEN_MAX = 4096


def check_mode() -> str:
    """The check mode the environment asks for, validated before any I/O."""
    value = os.environ.get(CHECK_ENV, "async").strip().lower() or "async"
    if value not in CHECK_MODES:
        raise InvalidArgument(f"{CHECK_ENV}={value!r} is not one of {', '.join(CHECK_MODES)}")
    return value


class RingCheck:
    """One group's fingerprint ring: ``before`` each data op, ``after`` it."""

    def __init__(self, group: ProcessGroup, mode: str) -> None:
        if mode not in CHECK_MODES:
            raise InvalidArgument(f"check mode {mode!r} is not one of {', '.join(CHECK_MODES)}")
        n, me = group.size(), group.group_rank
        self.group = group
        self.comm = group.comm
        self.mode = "off" if n == 1 else mode
        self.sync = self.mode == "sync"
        self.next = group.ranks[(me + 1) % n]
        self.prev = group.ranks[(me - 1) % n]
        #: calls (fingerprint, site id) the previous rank has already confirmed once
        self.seen: set[tuple[Fingerprint, int]] = set()
        #: a confirmed call's frame, sent by ``flush`` once its data op is enqueued
        self.deferred: tuple[bytes, Call] | None = None

    def before(self, call: Call) -> None:
        """Send this call's fingerprint to the next rank and take the previous rank's
        (waiting for it in ``sync`` mode). A mismatch raises ``CollectiveMismatch``."""
        if self.mode == "off":
            return
        comm, gid, fp = self.comm, self.group.id, call.fp
        pending = comm.router.post_coll((gid, call.seq, self.prev, 0, Flag.CHECK), _NOTHING)
        header = encode_header(Kind.COLL, gid, call.seq, fp.op, fp.dtype, fp.reduce,
                               fp.flags | Flag.CHECK, fp.root, fp.count, 0, call.site.id, 0, 0)
        key = (fp, call.site.id)
        if not self.sync and key in self.seen:
            # confirmed before: the frame goes out once the data op is enqueued
            # (``flush``), so sending it overlaps the op instead of delaying its start
            self.deferred = (header, call)
            return
        comm.send_frame(self.next, header, None, call.deadline, call.site)
        self._wait(call, pending)
        if not self.sync:
            if len(self.seen) >= _SEEN_MAX:
                self.seen.clear()
            self.seen.add(key)

    def flush(self) -> None:
        """Send the fingerprint ``before`` deferred (the data op is in flight now).

        Never raises. The frame only feeds the next rank's check, and that rank may
        already have finished this op and left: a confirmed call does not wait for the
        frame, so in a correct program the next rank can complete the op, call
        ``destroy_process_group`` and be gone before this rank, descheduled on a loaded
        machine, gets here. Whether this call is hurt by a departed or failed peer is
        for the data op's own wait to say (it watches the control plane for that
        peer's cause); and when the body already raised, its error is the one to show."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            header, call = deferred
            try:
                self.comm.send_frame(self.next, header, None, call.deadline, call.site)
            except DistError as exc:
                log.debug("rankwise: fingerprint for rank %d not sent: %s", self.next, exc)

    def _wait(self, call: Call, pending: Pending) -> None:
        def what() -> str:
            return (f"rank {self.comm.rank} timed out after {self.group.timeout:.0f}s in "
                    f"{call.record.describe()} (collective #{call.seq} of {self.group.name}) "
                    f"waiting for rank {self.prev}'s call (RANKWISE_CHECK=sync)")
        self.comm.activity.waiting_for = self.prev
        self.comm.wait(pending, call.deadline, what, patient=call.patient, quiet=call.quiet)

    def after(self) -> None:
        """The data op finished here: if a mismatch is known by now, its data must not be
        handed back as if it were good (one attribute read on the fast path)."""
        failure = self.comm.router.failure
        if failure is not None:
            self.comm.await_diagnosis()
            raise self.comm.as_of_now(failure)
