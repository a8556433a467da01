"""Point-to-point on the NCCL engine: tensors over NCCL's send/recv, announced and checked
on rankwise's control plane.

Why: through host memory (the fallback) a CUDA send costs two copies over PCIe and a
host sync. Here the data stays on the GPU; what NCCL lacks rankwise adds (docs/gpu.md,
"Point-to-point on NCCL"):

- tags and checks: each send first sends a header (``device.p2p_book``) on the control
  plane; the receiver matches headers by (source, tag) and compares dtype and size
  before it enters NCCL, so a mismatch is a ``CollectiveMismatch`` on both ranks (told
  to the job: the sender's data waits in NCCL), not a hang;
- bounded waits: every NCCL work is watched by the engine's book (``work_book``),
  a receive waits for its header in slices that see the job's failures and a lost
  source, and the first op of each direction between two ranks (which makes NCCL's
  communicator for the pair, blocking until the peer joins) runs on a helper thread,
  bounded (``bounded_enqueue``), like ``nccl.first_collective``;
- progress: while receives are posted a reader thread reads their headers, so each
  NCCL receive is enqueued as soon as its message is known;
- no exchange deadlock: NCCL runs a pair's send and recv on one stream, so two ranks
  that both send first would wait for each other on the GPU; here each direction has
  its own torch group (``pg_for``: the engine's group from the lower rank to the
  higher, a second one the other way), so a send never waits for the sender's own
  receives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import CollectiveMismatch, DistError, DistTimeout
from ...wire.buffers import dtype_name
from ..device.p2p_book import Header, HeaderMatcher, Receive, decode, encode
from .failures import TORCH_ERRORS

if TYPE_CHECKING:
    from ..base import Call
    from .device_waits import DeviceWaits
    from .work_book import Pending

__all__ = ["HeaderLink", "NcclP2P", "StandInGroup", "bounded_enqueue"]

#: seconds a receive waits for headers before it looks at the job's state again
SLICE = 0.05


class HeaderLink(Protocol):
    """The control plane as device p2p sees it (``api.p2p_nccl.ControlLink``)."""

    def send(self, dst: int, payload: bytes, deadline: float) -> None:
        """Send a header to global rank ``dst``."""

    def next(self, timeout: float) -> tuple[int, bytes] | None:
        """The next header from any rank, (source, payload), waited for up to
        ``timeout`` seconds (None: none came); raises the job's failure."""

    def failure(self) -> BaseException | None:
        """The job's failure, as this rank should raise it; None while all is well."""

    def gone(self, rank: int) -> BaseException | None:
        """Why ``rank`` is gone, None while it is there."""


#: seconds a broken first op waits for the job's failure that may explain it
EXPLAIN = 2.0


def _failure_within(failure: Callable[[], BaseException | None],
                    seconds: float) -> BaseException | None:
    """The job's failure, if it is known within ``seconds`` (looked at every 10 ms)."""
    end = time.monotonic() + seconds
    while True:
        failed = failure()
        if failed is not None or time.monotonic() >= end:
            return failed
        time.sleep(0.01)


def bounded_enqueue(enqueue: Callable[[], Any], *, failure: Callable[[], BaseException | None],
                    timeout: float, what: Callable[[], str],
                    on_timeout: Callable[[], None]) -> Any:
    """``enqueue()`` (a torch op that may block in NCCL's communicator creation until a
    peer joins) on a helper thread, waited for up to ``timeout`` s and released by the
    job's failure; ``on_timeout`` (the group's abort) runs before ``DistTimeout``."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(enqueue())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box.append(exc)

    helper = threading.Thread(target=run, name="rankwise-nccl-pair", daemon=True)
    helper.start()
    deadline = time.monotonic() + timeout
    while True:
        helper.join(SLICE)
        if box:
            if isinstance(box[0], BaseException):
                # a peer that failed (a mismatch it found) closes its connections: its own
                # report, on the control plane, may come just after and explains this
                why = _failure_within(failure, EXPLAIN)
                if why is not None:
                    raise why
                if isinstance(box[0], DistError):
                    raise box[0]
                raise DistError(f"{what()} failed: {box[0]}") from box[0]
            return box[0]
        failed = failure()
        if failed is not None:
            raise failed
        if time.monotonic() >= deadline:
            on_timeout()
            raise DistTimeout(f"{what()} was not made within {timeout:.0f}s: the peer did "
                              "not post its matching send or recv, or NCCL cannot reach it "
                              "(NCCL_DEBUG=INFO shows which)")


class NcclP2P:
    """One group's device p2p on one rank. ``pg_for(src, dst)``: the torch group that
    carries messages from global rank ``src`` to ``dst``; ``group_rank``: a global
    rank's rank in it; ``waits``: the engine's book and streams; ``scratch(nbytes)``:
    a byte tensor on the group's device; ``first_contact(peer, enqueue)``: runs the
    first op between this rank and ``peer`` (bounded); ``tell(exc)``: fails the job
    with a mismatch found here; ``reader``: a thread reads headers while receives are
    posted (without it only waiting receives do: the in-process tests); ``check(call,
    tensors)``: ``InvalidArgument`` before any I/O for a tensor off the group's device."""

    def __init__(self, *, rank: int, group_rank: Callable[[int], int],
                 pg_for: Callable[[int, int], Any], waits: DeviceWaits,
                 scratch: Callable[[int], Any], link: HeaderLink,
                 tell: Callable[[BaseException], None],
                 first_contact: Callable[[int, Callable[[], Any]], Any],
                 clock: Callable[[], float] = time.monotonic, reader: bool = True,
                 check: Callable[[Any, tuple[Any, ...]], None] | None = None) -> None:
        self.rank = rank
        self._group_rank = group_rank
        self._pg_for = pg_for
        self.waits = waits
        self._scratch = scratch
        self.link = link
        self._tell = tell
        self._first_contact = first_contact
        self._check = check
        self._clock = clock
        self.book = HeaderMatcher(self._issue, self._mismatch)
        self._send_lock = threading.Lock()
        self._sent: dict[int, int] = {}  #: device messages sent, per destination
        #: directions (src, dst) whose torch group has made NCCL's pair communicator
        self._paired: set[tuple[int, int]] = set()
        self._pulling = threading.Lock()  #: held by the thread reading headers
        self._turn = threading.Condition()  #: a round of reading ended, or a post came
        self._reader: threading.Thread | None = None
        self._closed = not reader  #: ``reader``: a thread reads headers (tests: no)
        #: what stopped the reader thread (a peer's malformed header), raised by waiters
        self._error: BaseException | None = None

    def check(self, call: Call, tensor: Any) -> None:
        """``InvalidArgument`` for a tensor off the group's device (no I/O)."""
        if self._check is not None:
            self._check(call, (tensor,))

    # --- sending -----------------------------------------------------------------------

    def send(self, call: Call, tensor: Any, dst: int, tag: int, site: str,
             shape: tuple[int, ...]) -> Pending:
        """Announce, then enqueue, a send of the flat ``tensor`` to global rank ``dst``;
        returns the watched work (the caller orders its stream after it, or not)."""
        self.check(call, tensor)
        self.waits.raise_failed()
        fp = call.fp
        with self._send_lock:  # headers and NCCL sends to one peer in the same order
            number = self._sent.get(dst, 0)
            header = Header(self.rank, number, tag, fp.dtype, fp.count,
                            tensor.numel() * tensor.element_size(), shape, site)
            self.link.send(dst, encode(header), call.deadline)
            self._sent[dst] = number + 1
            raw = tensor.view(_uint8())
            pg, peer = self._pg_for(self.rank, dst), self._group_rank(dst)
            work = self._enqueue(self.rank, dst, lambda: pg.send([raw], peer, 0))
            return self.waits.watch(call, work)

    # --- receiving ---------------------------------------------------------------------

    def post(self, call: Call, tensor: Any, src: int, tag: int) -> Receive:
        """Post a receive into the flat ``tensor`` (``src`` -1: any); it is matched
        now if its header is here, else when it is read (the reader thread, ``finish``,
        ``done``)."""
        self.check(call, tensor)
        self.waits.raise_failed()
        r = Receive(src, tag, call.fp.dtype, call.fp.count, tensor, call.describe, call)
        self.book.post(r)
        self.progress()
        with self._turn:
            if self._reader is None and not r.ready.is_set() and not self._closed:
                self._reader = threading.Thread(target=self._read, daemon=True,
                                                name="rankwise-nccl-p2p")
                self._reader.start()
            self._turn.notify_all()  # the reader: a receive waits
        return r

    def progress(self) -> None:
        """Read the headers that are here, without waiting."""
        while self._round(0.0):
            pass

    def _round(self, timeout: float) -> bool:
        """Read one header, waiting up to ``timeout`` s (another thread reading: wait for
        its round); True if one was read."""
        if self._error is not None:
            raise self._error
        if not self._pulling.acquire(blocking=False):
            if timeout > 0:
                with self._turn:
                    self._turn.wait(timeout)
            return False
        try:
            got = self.link.next(timeout)
            if got is not None:
                self.book.arrive(decode(*got))
            return got is not None
        finally:
            self._pulling.release()
            with self._turn:
                self._turn.notify_all()

    def _read(self) -> None:
        """The reader thread: while receives are posted, read their headers, so that
        each NCCL receive is enqueued as soon as its message is known (an ``irecv``
        nobody waits for yet included: its sender's NCCL send needs it)."""
        while True:
            with self._turn:
                while not self._closed and not self.book.pending():
                    self._turn.wait()
                if self._closed:
                    return
            if self.link.failure() is not None:
                return  # every waiter raises the job's failure itself
            try:
                self._round(SLICE)
            except BaseException as exc:  # noqa: BLE001 - raised by every waiter
                self._error = exc
                with self._turn:
                    self._turn.notify_all()
                return

    def close(self) -> None:
        """Stop the reader thread (the engine is closing)."""
        with self._turn:
            self._closed = True
            self._turn.notify_all()

    def done(self, r: Receive) -> bool:
        """``is_completed``: matched, and its NCCL receive finished."""
        if not r.ready.is_set():
            self.progress()
            if not r.ready.is_set():
                return False
        if r.error is not None:
            return True
        p = (r.stash if r.stash is not None else r.handle)[0]
        return bool(p.done())

    def finish(self, r: Receive, timeout: float | None = None) -> int:
        """``match`` then ``complete``: the sender's global rank."""
        self.match(r, timeout)
        return self.complete(r)

    def match(self, r: Receive, timeout: float | None = None) -> None:
        """Wait (bounded: ``timeout`` s from now, else the call's deadline) until ``r`` is
        matched and its NCCL receive enqueued: the part that waits for a peer's send."""
        deadline = r.call.deadline if timeout is None else self._clock() + timeout
        self._await(r, deadline)
        if r.error is not None:
            raise r.error

    def complete(self, r: Receive) -> int:
        """Order this thread's stream after the matched ``r``'s data (the host waits only
        on the CPU stand-in); returns the sender's global rank."""
        call = r.call
        assert r.header is not None
        if r.stash is not None:  # received early into scratch: copy it out, in order
            p, scratch = r.stash
            self.waits.order(call, p)
            r.target.view(_uint8()).copy_(scratch)
        else:
            self.waits.order(call, r.handle[0])
        return r.header.src

    def _await(self, r: Receive, deadline: float) -> None:
        link = self.link
        while not r.ready.is_set():
            failed = link.failure() or (link.gone(r.src) if r.src != -1 else None)
            left = deadline - self._clock()
            if failed is not None or left <= 0:
                self.book.cancel(r)
                if r.ready.is_set():  # matched meanwhile: take it
                    return
                if failed is not None:
                    raise failed
                who = "any rank" if r.src == -1 else f"rank {r.src}"
                tags = self.book.untaken(r.src)
                raise DistTimeout(
                    f"rank {self.rank} timed out in {r.describe()} from {who} (tag {r.tag}) "
                    "on nccl: no matching send was announced" + (
                        f" (messages from {who} with tags {sorted(set(tags))} wait for "
                        "their receives)" if tags else ""))
            self._round(min(SLICE, left))

    # --- the book's callbacks ----------------------------------------------------------

    def _issue(self, h: Header, r: Receive, scratch: bool) -> tuple[Pending, Any]:
        target = self._scratch(h.nbytes) if scratch else r.target.view(_uint8())
        pg, peer = self._pg_for(h.src, self.rank), self._group_rank(h.src)
        work = self._enqueue(h.src, self.rank, lambda: pg.recv([target], peer, 0))
        return self.waits.watch(r.call, work), target

    def _mismatch(self, h: Header, r: Receive) -> BaseException:
        shape = f"[{', '.join(map(str, h.shape))}]" if len(h.shape) != 1 else f" x {h.numel}"
        exc = CollectiveMismatch(
            f"point-to-point mismatch: rank {h.src} sent {dtype_name(h.dtype)}{shape} "
            f"(tag {h.tag}) at {h.site or 'an unknown site'}, but rank {self.rank} received "
            f"it with {r.describe()}; send and recv must pass tensors of the same dtype and "
            "number of elements (found from the header: NCCL was not entered)")
        self._tell(exc)
        return exc

    def _enqueue(self, src: int, dst: int, enqueue: Callable[[], Any]) -> Any:
        """The op on the torch group of direction ``src`` -> ``dst``; its first one
        makes NCCL's communicator for the pair there (bounded, ``first_contact``)."""
        if (src, dst) in self._paired:
            return enqueue()
        work = self._first_contact(dst if src == self.rank else src, enqueue)
        self._paired.add((src, dst))
        return work


class StandInGroup:
    """torch's gloo standing in for NCCL (``RANKWISE_TENSOR_PATH=device``): gloo marks a
    send/recv work complete only inside ``wait()`` (``is_completed`` stays False), and
    the book's pass only polls. So each work is waited for on a thread of its own (bounded
    by gloo's own timeout); tests only."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def send(self, tensors: list[Any], peer: int, tag: int) -> Any:
        return _Waited(self.pg.send(tensors, peer, tag))

    def recv(self, tensors: list[Any], peer: int, tag: int) -> Any:
        return _Waited(self.pg.recv(tensors, peer, tag))


class _Waited:
    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="rankwise-stand-in-p2p", daemon=True).start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except TORCH_ERRORS as exc:
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()

    def wait(self, *args: Any) -> bool:
        self._done.wait()  # asked only once ``is_completed`` said so
        if self._error is not None:
            raise self._error
        return True


def _uint8() -> Any:
    import torch

    return torch.uint8
