"""Fingerprint checks on the control plane, for engines whose data rankwise does not own
(torch's gloo, NCCL): each rank sends each call's fingerprint to its ring neighbour.
``RANKWISE_CHECK`` = ``async`` (default; confirmed calls batched), ``sync`` or ``off``.
Why and what it costs: docs/design.md, "Ring check for foreign engines".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from ..engines.base import CHECK_MODES, Call, Observer
from ..errors import DistError, InvalidArgument
from ..identity.calls import Fingerprint
from ..wire.frames import CHECK_ENTRY, CHECK_KEY, Flag, Kind, encode_header
from .failures import call_timeout
from .router import Pending

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["BATCH", "BATCH_AGE", "RingCheck"]

log = logging.getLogger("rankwise")

_NOTHING = memoryview(bytearray())
#: confirmed (fingerprint, call site) pairs remembered per group (``async`` first sight)
_SEEN_MAX = 4096
#: confirmed calls whose fingerprints are sent in one frame, at most. Why 64, not 16:
#: each batch costs the sender a system call and wakes the receiver's I/O thread, which
#: on loopback and two cores stalls both ranks' next op (measured: 16 per batch cost a
#: 4-byte all_reduce ~70 us more than no checks; without batches it costs ~nothing).
#: ``BATCH_AGE`` still bounds how late a silently accepted mismatch is reported.
BATCH = 64
#: seconds a confirmed call's fingerprint waits for others to share its frame, at most
#: (looked at when a later call's data op is enqueued)
BATCH_AGE = 0.05
_pack_entry = CHECK_ENTRY.pack
#: a plain int: ``int | Flag`` runs IntFlag's ``__ror__`` in Python, per call
_CHECK = int(Flag.CHECK)


class RingCheck(Observer):
    """One group's fingerprint ring: ``before`` each data op, ``after`` it; an observer
    of the group's calls on a foreign engine (``api.observers``, ``engines.base.Observer``).

    Lock-free between the calling thread and the device book's pass (``flush`` from the
    ledger's thread, when an op runs long): confirmed calls' entries go to a deque the
    caller appends to, and whoever flushes pops them (each ``popleft`` is atomic), so
    each entry is sent once, by one of them. Two flushes at once may split a batch in
    two frames: the next rank judges each entry by its sequence number alone."""

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
        #: confirmed calls' fingerprints not sent yet (``CHECK_ENTRY`` each), and the
        #: last of those calls (its site and seq name the batch frame)
        self._entries: deque[bytes] = deque()
        self._last: Call | None = None
        self._since = 0.0  #: when the oldest deferred fingerprint was added

    def before(self, call: Call) -> None:
        """Send this call's fingerprint to the next rank and take the previous rank's
        (waiting for it in ``sync`` mode). A mismatch raises ``CollectiveMismatch``."""
        if self.mode == "off":
            return
        comm, gid, fp, site = self.comm, self.group.id, call.fp, call.site.id
        key = (fp, site)
        if not self.sync and key in self.seen:
            # confirmed before: the fingerprint joins the batch (see the module's doc);
            # the previous rank's is judged when it comes, no receive is posted for it
            # (``CheckBatches.take``)
            entry = _pack_entry(call.seq, fp.op, fp.dtype, fp.reduce, fp.flags | _CHECK,
                                fp.root, fp.count, site)
            # the previous rank's entry must equal ours but for the site: the router
            # compares the bytes (``CheckBatches.take``)
            comm.router.checks.expect(gid, call.seq, entry[:CHECK_KEY])
            entries = self._entries
            if not entries:
                self._since = time.monotonic()
            self._last = call
            entries.append(entry)
            return
        pending = comm.router.post_coll((gid, call.seq, self.prev, 0, _CHECK), _NOTHING)
        self.flush()  # the batch first: the next rank judges calls in order
        header = encode_header(Kind.COLL, gid, call.seq, fp.op, fp.dtype, fp.reduce,
                               fp.flags | _CHECK, fp.root, fp.count, 0, site, 0, 0)
        comm.send_frame(self.next, header, None, call.deadline, call.site)
        self._wait(call, pending)
        if not self.sync:
            if len(self.seen) >= _SEEN_MAX:
                self.seen.clear()
            self.seen.add(key)

    @property
    def deferred(self) -> bytes | None:
        """The entries not sent yet, as one payload (None: none)."""
        return b"".join(list(self._entries)) or None

    def enqueued(self, call: Call) -> None:
        """A data op is in flight: send the batch if it is full or old."""
        entries = self._entries
        if entries and (len(entries) >= BATCH or time.monotonic() - self._since >= BATCH_AGE):
            self.flush()

    def flush(self) -> None:
        """Send the fingerprints ``before`` deferred, now.

        Never raises. The frame only feeds the next rank's check, and that rank may
        already have finished this op and left: a confirmed call does not wait for the
        frame, so in a correct program the next rank can complete the op, call
        ``destroy_process_group`` and be gone before this rank, descheduled on a loaded
        machine, gets here. Whether this call is hurt by a departed or failed peer is
        for the data op's own wait to say (it watches the control plane for that
        peer's cause); and when the body already raised, its error is the one to show."""
        entries = self._entries
        parts = []
        try:
            while True:
                parts.append(entries.popleft())
        except IndexError:
            pass
        call = self._last
        if parts and call is not None:
            deferred = b"".join(parts)
            header = encode_header(Kind.CHECKS, self.group.id, call.seq, site=call.site.id,
                                   payload_len=len(deferred))
            try:  # a fresh deadline: a batch may be sent long after its last call began
                self.comm.send_frame(self.next, header, memoryview(deferred),
                                     time.monotonic() + self.group.timeout, call.site)
            except DistError as exc:
                log.debug("rankwise: fingerprint for rank %d not sent: %s", self.next, exc)

    def _wait(self, call: Call, pending: Pending) -> None:
        def what() -> str:
            return call_timeout(self.comm.rank, call, f" waiting for rank {self.prev}'s call "
                                                      "(RANKWISE_CHECK=sync)")

        self.comm.doing.waiting_for = self.prev
        self.comm.wait(pending, call.deadline, what, patient=call.patient, quiet=call.quiet)

    def after(self, call: Call) -> None:
        """The data op finished here: if a mismatch is known by now, its data must not be
        handed back as if it were good (one attribute read on the fast path)."""
        if self.comm.router.failure is not None:
            self.comm.port.raise_failure()

