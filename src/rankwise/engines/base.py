"""The engine seam: a call description in, the collective done (or an exception) out.

Why a seam: the API layer (argument checks, fingerprints, call sites, history, async
handles) is the same whichever engine moves the bytes, so it lives once above this
interface, and each engine implements only the data movement. Every method blocks the
calling thread until the call is complete on this rank and honours ``call.deadline``.
Failures are reported as three plain facts (``CallsDisagree``, ``PeerGone``,
``DeadlinePassed``) that core words (``core.failures``); the rest of the job is reached
through ``group.port`` only (``core.port``). Arrays are contiguous and 1-D; ranks are
group-local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy.typing as npt

from .. import settings
from ..errors import DistError
from ..identity.calls import describe, op_name
from ..slots import fast_new
from ..wire.buffers import DType, ReduceOp

if TYPE_CHECKING:
    from ..core.group import ProcessGroup
    from ..identity.calls import Fingerprint
    from ..identity.callsite import CallSite

__all__ = ["CHECK_ENV", "CHECK_MODES", "HOST_CAPS", "NO_OBSERVERS", "Array", "Call",
           "CallsDisagree", "Caps", "DeadlinePassed", "Engine", "EngineFact",
           "EngineUnavailable", "Observer", "Observers", "PeerGone", "Tiles", "check_mode"]

Array = npt.NDArray[Any]


class Tiles(list[Any]):
    """The per-rank slots of a collective that tile one flat buffer, ``whole``, in rank
    order (``all_gather_into_tensor``'s output, ``reduce_scatter``'s input): a list as
    every engine takes it, and the buffer for an engine whose backend moves it in one op
    (torch's gloo: ``_allgather_base``, ``_reduce_scatter_base``, the same ops and so
    the same bits as a script on gloo gets)."""

    __slots__ = ("whole",)

    def __init__(self, slots: list[Any], whole: Any) -> None:
        super().__init__(slots)
        self.whole = whole

#: how engines whose data rankwise does not own check calls (``core.ring_check``)
CHECK_ENV = "RANKWISE_CHECK"
CHECK_MODES = settings.choices(CHECK_ENV)


def check_mode() -> str:
    """The check mode the environment asks for, validated before any I/O."""
    return settings.choice(CHECK_ENV)


class EngineUnavailable(DistError):
    """The engine asked for cannot serve this group (said once, with the reason)."""


class EngineFact(Exception):
    """A plain fact an engine reports about a call; the guard in core
    (``core.failures.explain``) turns it into the public exception, worded once."""


class CallsDisagree(EngineFact):
    """The ranks disagree on the call. ``first``: (global rank, call described) of the
    side that disagrees first, when it is not this rank's own call; ``peer`` and ``theirs``:
    the other side (``theirs`` gets the peer's reported shape, None when unknown);
    ``detail``: what differs beyond the calls; ``report``: gather every rank's recent calls
    and tell the peers; ``fail_group``: every later call of the job raises it too."""

    def __init__(self, detail: str = "", *, peer: int | None = None,
                 theirs: Callable[[tuple[int, ...] | None], str] | None = None,
                 their_flags: int | None = None, first: tuple[int, str] | None = None,
                 report: bool = False, fail_group: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.peer = peer
        self.theirs = theirs
        self.their_flags = their_flags
        self.first = first
        self.report = report
        self.fail_group = fail_group


class PeerGone(EngineFact):
    """A peer (``rank``, global; None: some member) is gone or its op failed; ``detail``:
    what the engine saw. The control plane's account of why beats it when there is one."""

    def __init__(self, rank: int | None, detail: str, *, where: str = "") -> None:
        super().__init__(detail)
        self.rank = rank
        self.detail = detail
        self.where = where


class DeadlinePassed(EngineFact):
    """The call's deadline passed; ``where`` ends the sentence (`` on shared memory``),
    ``detail`` is what the engine was waiting for."""

    def __init__(self, where: str, detail: str = "") -> None:
        super().__init__(detail)
        self.where = where
        self.detail = detail


class Observer:
    """One check or record around every call of a group on one engine (``api.observers``
    builds the set): ``before`` once the engine's local checks passed and before any of
    the call's data moves, ``enqueued`` once its data op is in flight, then ``after`` or
    ``failed``. An engine never knows which observers there are. A hook an observer does
    not override costs a call nothing: ``Observers`` leaves it out."""

    def before(self, call: Call) -> None:
        return None

    def enqueued(self, call: Call) -> None:
        return None

    def after(self, call: Call) -> None:
        return None

    def failed(self, call: Call, exc: BaseException) -> None:
        return None


def _nothing(*args: Any) -> None:
    return None


def _phase(hooks: tuple[Callable[..., None], ...]) -> Callable[..., None]:
    """One callable running ``hooks`` in order: none (a no-op), the one hook itself, or a
    loop. Why: a phase is a Python call per call, and most phases have one hook."""
    if not hooks:
        return _nothing
    if len(hooks) == 1:
        return hooks[0]

    def each(call: Call, *exc: BaseException) -> None:
        for hook in hooks:
            hook(call, *exc)

    return each


def _overridden(members: tuple[Observer, ...], name: str) -> list[Callable[..., None]]:
    """The ``name`` hooks of ``members`` that do something (``Observer``'s own do not)."""
    default = getattr(Observer, name)
    return [getattr(o, name) for o in members
            if getattr(getattr(o, name), "__func__", None) is not default]


class Observers:
    """A group's observers on one engine, as the callable each phase runs: ``before``
    and ``enqueued`` in order, ``after`` and ``failed`` in reverse (the first observer
    opened first closes last, as nested blocks). Made once per group and engine
    (``api.observers.observed``), never per call."""

    __slots__ = ("after", "before", "by_path", "enqueued", "failed", "members")

    def __init__(self, members: tuple[Observer, ...] = (), by_path: bool = True) -> None:
        self.members = members
        #: the call path runs ``before`` (False: the engine does, after its local checks)
        self.by_path = by_path
        self.before: Callable[[Call], None] = _phase(tuple(_overridden(members, "before")))
        #: the engine's op for the call is in flight (foreign engines report it)
        self.enqueued: Callable[[Call], None] = _phase(tuple(_overridden(members, "enqueued")))
        self.after: Callable[[Call], None] = _phase(tuple(_overridden(members, "after")[::-1]))
        self.failed: Callable[[Call, BaseException], None] = _phase(
            tuple(_overridden(members, "failed")[::-1]))


#: a call run outside the call path (an engine driven directly): nothing observes it
NO_OBSERVERS = Observers()


@dataclass(slots=True)
class Call:
    """One collective call as the API registered it: what every engine runs, and its
    entry in the group's history (``ProcessGroup.history``).

    One object for both: a call and its record were two objects per call on the hot path
    (a 4-byte all_reduce is dominated by such per-call Python), and they describe the same
    thing. ``record`` (the call itself) stays for code that reads ``call.record.fp``.

    ``patient``: the caller waits on purpose (rank_zero_first's followers wait for rank
    0's block): no slow-wait warning, but still bounded by ``deadline``; ``quiet``: on
    timeout raise a bare ``DistTimeout`` because the caller builds its own report
    (``monitored_barrier``).
    """

    group: ProcessGroup
    seq: int
    fp: Fingerprint
    site: CallSite
    dtype: DType | None
    op: ReduceOp | None
    deadline: float
    started: float  #: time.time() when the call was registered
    shape: tuple[int, ...] | None = None  #: the user's tensor's, shown in messages
    finished: float = 0.0  #: time.time() when it ended here (0: not yet)
    patient: bool = False
    quiet: bool = False
    label: str | None = None  #: ``record_comm``'s name for it (traces, async ``Work``)
    #: while an ``async_op`` call runs on the caller's thread (a device engine's
    #: ``run_inline``): its device records, ordered when the ``Work`` is waited for
    inline: list[Any] | None = None
    #: what observes it (``api.observers``): an engine that reports its phases
    #: (``Caps.ring``) runs ``observers.before`` after its local checks and
    #: ``observers.enqueued`` once its op is in flight
    observers: Observers = NO_OBSERVERS
    event: Any = None  #: the profiler's event, while one records (``api.profiling``)

    @property
    def record(self) -> Call:
        return self

    @property
    def rank(self) -> int:
        return self.group.group_rank

    @property
    def size(self) -> int:
        return len(self.group.ranks)

    def describe(self, site: bool = True) -> str:
        """``all_reduce(float32 x 4, op=SUM) at train.py:42 in step`` (slow path only)."""
        return describe(self.fp, self.site if site else None, self.shape)

    def title(self) -> str:
        """``all_reduce #5 on default_pg`` (``record_comm``'s label for the op): an
        async call's ``Work`` description, made when asked for (slow path only)."""
        return f"{self.label or op_name(self.fp.op)} #{self.seq} on {self.group.name}"


#: ``Call(...)`` of positional values, without the dataclass's Python ``__init__``
#: (``rankwise.slots``): one is made per collective
new_call = fast_new(Call)


@dataclass(frozen=True, slots=True)
class Caps:
    """What an engine can do besides running a call to its end on the caller's thread,
    declared (``Engine.caps``) so that the call path (``api.path``) asks a field, never
    ``getattr``. None: the engine cannot, the call path does without.

    ``run_inline(call, job, *args) -> (device side, error)``: an ``async_op`` call runs
    ``job(*args)`` here, on the caller's thread, its works ordered on the caller's stream
    when the ``Work`` is waited for (a device engine: ``DeviceWaits.run_inline``).
    ``adopt_async(job) -> (job, device side)``: an async call queued on the async worker
    runs after what the caller's stream holds now (a device engine's side stream).
    ``run_split``: as ``run_inline``, for the async calls whose body ends with the
    engine's op (``api.path.launch``'s ``split``) on an engine that completes its ops on
    threads of its own (torch's gloo: ``engines.torch.host_async``)."""

    run_inline: Callable[..., tuple[Any, BaseException | None]] | None = None
    run_split: Callable[..., tuple[Any, BaseException | None]] | None = None
    adopt_async: Callable[[Callable[[], None]], tuple[Callable[[], None], Any]] | None = None
    #: the engine moves data rankwise does not own (torch's gloo, NCCL): its calls are
    #: checked on the control plane (``core.ring_check`` in this ``RANKWISE_CHECK`` mode)
    #: and it reports its own phases to ``Call.observers`` (``before`` once its local
    #: checks passed, ``enqueued`` once its op is in flight). None: rankwise's own data;
    #: the call path runs ``before`` itself, and nothing is in flight but the call
    ring: str | None = None
    #: with ``ring``: what the observers hold back to send later (the ring check's
    #: batch), sent by the engine when an op runs slow, at ``settle`` and at ``close``
    held: list[Callable[[], None]] | None = None

    def send_held(self) -> None:
        """Send what the observers hold back (the engine calls it; never raises)."""
        for send in self.held or ():
            send()


#: a host engine's: every call on the caller's thread or the async worker, no streams
HOST_CAPS = Caps()


class Engine(Protocol):
    """What a group's data plane offers. ``name`` is shown in reports and benchmarks.

    ``serial``: the engine runs one call at a time, in the order calls reach it (shared
    memory: one set of slots). The API then keeps call order across threads: a blocking
    call waits for the group's queued ``async_op`` calls before it starts. Without that,
    one rank could run a blocking call before an earlier async one while another rank
    runs them the other way round — and two calls with equal fingerprints (two DDP
    buckets of one size) would swap data silently.
    """

    name: str
    serial: bool
    #: the data moves in frames that the router matches to calls (it must be told of
    #: each call); False for engines that never send a collective frame
    framed: bool
    #: what else it can do (``Caps``; host engines: ``HOST_CAPS``)
    caps: Caps

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        """Root's ``data`` into every rank's ``data``."""

    def all_reduce(self, call: Call, data: Array) -> None:
        """``data`` becomes the reduction (``call.op``) of every rank's ``data``."""

    def reduce(self, call: Call, data: Array, root: int) -> None:
        """The reduction lands in the root's ``data`` (others' may be scratched)."""

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        """``slots[rank]`` holds this rank's part already; fill everyone else's."""

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        """Every rank's ``mine`` into the root's ``slots`` (None elsewhere)."""

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        """The root's ``slots[r]`` into rank r's ``out``."""

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        """``chunks[rank]`` becomes the reduction of every rank's ``chunks[rank]``
        (the other chunks are scratch)."""

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        """This rank's ``ins[r]`` into rank r's ``outs[this rank]``; sizes may vary by
        pair but each pair agrees."""

    def barrier(self, call: Call) -> None:
        """Return once every rank of the group has entered the same barrier."""

    def settle(self) -> None:
        """Send what this engine still owes its peers, before this rank's goodbye.

        Why before: a peer reads our goodbye and stops listening; anything sent after it
        (the torch engine's last batch of fingerprints) would never be checked, and a
        mismatch in a job's last calls would pass unreported."""

    def close(self) -> None:
        """Release the engine's resources (the group is being destroyed)."""
