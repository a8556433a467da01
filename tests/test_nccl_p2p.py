"""Point-to-point on NCCL (issue 28), in-process with fakes: no GPU, no NCCL here.

Each rank is an ``NcclP2P`` over a fake torch group (``FakeNet``: per-direction FIFOs
that pair sends with receives in order and copy the bytes, as NCCL would, with no tags),
a fake control plane for the headers (``FakeLink``), the engine's real watchdog with a
fake clock, and CUDA-like streams (ordering never blocks the host). Asserted: messages
match by (source, tag) in arrival order and receives in post order; a header that does
not fit its receive raises before the fake NCCL receive is entered; a send nobody
receives ends in the watchdog's DistTimeout, a dead peer in PeerFailure; the first op
between two ranks is bounded; the switch and the host fallback. No sleeps.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from rankwise.engines.device.p2p_book import Header, decode, encode
from rankwise.engines.torch.p2p import NcclP2P, bounded_enqueue
from rankwise.engines.torch.streams import CudaStreams, DeviceWaits, Streams
from rankwise.engines.torch.watchdog import Watchdog
from rankwise.errors import CollectiveMismatch, DistError, DistTimeout, InvalidArgument, PeerFailure
from rankwise.identity.calls import Fingerprint
from rankwise.wire.buffers import as_buffer
from rankwise.wire.frames import Op

torch = pytest.importorskip("torch")

F32 = as_buffer(torch.zeros(1).numpy(), "t").dtype.code
I64 = as_buffer(torch.zeros(1, dtype=torch.int64).numpy(), "t").dtype.code


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWork:
    """A torch work that completes when the fake net pairs it; ``wait`` is a stream
    wait (recorded), never a host block."""

    def __init__(self, reads: bool = False) -> None:
        self.landed = threading.Event()
        self.waits = 0
        #: a receive whose data the caller reads next: on CUDA the read (``tolist``)
        #: syncs with the stream, so here ``wait`` stands for it and waits, bounded
        self.reads = reads

    @property
    def completed(self) -> bool:
        return self.landed.is_set()

    @completed.setter
    def completed(self, value: bool) -> None:
        if value:
            self.landed.set()

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, *args: Any) -> bool:
        assert not args, "a timed wait: NCCL's watchdog would tear the process down"
        self.waits += 1
        if self.reads:
            assert self.landed.wait(10.0), "the data never came"
        return True


class FakeNet:
    """NCCL's p2p semantics: per direction, the n-th send meets the n-th receive."""

    def __init__(self, reads: bool = False) -> None:
        self.reads = reads  #: receives' ``wait`` syncs (``FakeWork.reads``)
        self.lock = threading.Lock()  #: thread-ranks share it
        self.sends: dict[tuple[int, int], deque[tuple[Any, FakeWork]]] = {}
        self.recvs: dict[tuple[int, int], deque[tuple[Any, FakeWork]]] = {}
        self.log: list[tuple[str, int, int, int]] = []  #: (op, me, peer, nbytes)

    def pg(self, me: int) -> Any:
        net = self

        class PG:
            def send(self, tensors: list[Any], peer: int, tag: int) -> FakeWork:
                return net._op("send", me, peer, tensors[0])

            def recv(self, tensors: list[Any], peer: int, tag: int) -> FakeWork:
                return net._op("recv", me, peer, tensors[0])
        return PG()

    def _op(self, op: str, me: int, peer: int, t: Any) -> FakeWork:
        assert t.dtype is torch.uint8, "bytes move as uint8"
        with self.lock:
            return self._op_locked(op, me, peer, t)

    def _op_locked(self, op: str, me: int, peer: int, t: Any) -> FakeWork:
        self.log.append((op, me, peer, t.numel()))
        key = (me, peer) if op == "send" else (peer, me)
        work = FakeWork(reads=self.reads and op == "recv")
        mine, other = (self.sends, self.recvs) if op == "send" else (self.recvs, self.sends)
        waiting = other.setdefault(key, deque())
        if waiting:
            t2, w2 = waiting.popleft()
            src, dst = (t, t2) if op == "send" else (t2, t)
            assert src.numel() == dst.numel(), "NCCL would hang or corrupt here"
            dst.copy_(src)
            work.completed = w2.completed = True
        else:
            mine.setdefault(key, deque()).append((t.clone() if op == "send" else t, work))
        return work


@dataclass
class FakeLink:
    """The control plane: headers per destination, in order; ``next`` with nothing
    there lets the fake clock pass the time it would have waited."""

    me: int
    boxes: dict[int, deque[tuple[int, bytes]]]
    clock: Clock
    failed: list[BaseException] = field(default_factory=list)
    dead: dict[int, BaseException] = field(default_factory=dict)

    def send(self, dst: int, payload: bytes, deadline: float) -> None:
        self.boxes.setdefault(dst, deque()).append((self.me, payload))

    def next(self, timeout: float) -> tuple[int, bytes] | None:
        box = self.boxes.setdefault(self.me, deque())
        if box:
            return box.popleft()
        self.clock.now += timeout
        return None

    def failure(self) -> BaseException | None:
        return self.failed[0] if self.failed else None

    def gone(self, rank: int) -> BaseException | None:
        return self.dead.get(rank)


class Plane:
    def __init__(self, link: FakeLink) -> None:
        self.link = link

    def failure(self) -> BaseException | None:
        return self.link.failure()

    def slow(self, call: Any) -> bool:
        return True

    def warn_at(self, call: Any, start: float) -> float:
        return float("inf")

    def warn(self, call: Any) -> None:
        pass

    def probe_at(self, start: float) -> float:
        return float("inf")

    def probe(self, blocked_for: float) -> float:
        return 1.0

    def timed_out(self, call: Any) -> BaseException:
        return DistTimeout(f"timed out in {call.describe()}")

    def op_failed(self, call: Any, err: BaseException) -> BaseException:
        return DistError(str(err))


class CudaLike(Streams):
    def order(self, p: Any) -> None:
        CudaStreams.order(self, p)  # type: ignore[arg-type]  # the real ordering rule


@dataclass
class Call:
    fp: Fingerprint
    deadline: float
    site: str
    patient: bool = False
    quiet: bool = False

    def describe(self, site: bool = True) -> str:
        name = Op(self.fp.op).name
        return f"{name}(dtype#{self.fp.dtype} x {self.fp.count}) at {self.site}"


class World:
    """``n`` ranks' device p2p, sharing one fake net, mailboxes and clock."""

    def __init__(self, n: int = 2) -> None:
        self.clock = Clock()
        self.net = FakeNet()
        self.boxes: dict[int, deque[tuple[int, bytes]]] = {}
        self.told: list[BaseException] = []
        self.contacts: list[tuple[int, int]] = []
        self.aborts: list[int] = []
        self.links = [FakeLink(r, self.boxes, self.clock) for r in range(n)]
        self.dogs = [Watchdog(Plane(link), lambda r=r: self.aborts.append(r),  # type: ignore[misc]
                              clock=self.clock) for r, link in enumerate(self.links)]
        self.ranks = [self._rank(r) for r in range(n)]

    def _rank(self, r: int) -> NcclP2P:
        def first(peer: int, enqueue: Any) -> Any:
            self.contacts.append((r, peer))
            return enqueue()

        return NcclP2P(rank=r, group_rank=lambda g: g, pg_for=lambda s, d: self.net.pg(r),
                       waits=DeviceWaits(self.dogs[r], CudaLike(), lambda c, e: e),
                       scratch=lambda n: torch.empty(n, dtype=torch.uint8),
                       link=self.links[r], tell=self.told.append, first_contact=first,
                       clock=self.clock, reader=False)

    def call(self, op: Op, t: Any, site: str, dtype: int = F32) -> Call:
        return Call(Fingerprint(int(op), dtype, 0, 0, t.numel()), self.clock.now + 5.0, site)

    def send(self, src: int, dst: int, t: Any, tag: int = 0, site: str = "a.py:1",
             dtype: int = F32) -> Any:
        return self.ranks[src].send(self.call(Op.send, t, site, dtype), t, dst, tag, site,
                                    tuple(t.shape))

    def post(self, me: int, src: int, t: Any, tag: int = 0, site: str = "b.py:2",
             dtype: int = F32) -> Any:
        return self.ranks[me].post(self.call(Op.recv, t, site, dtype), t, src, tag)

    def recvs(self, me: int) -> list[int]:
        """The byte sizes of the NCCL receives rank ``me`` entered, in order."""
        return [n for op, who, _, n in self.net.log if op == "recv" and who == me]


def _t(*values: float) -> Any:
    return torch.tensor(values, dtype=torch.float32)


# --- matching: (source, tag) in arrival order, receives in post order -------------------

def test_tags_match_in_arrival_order_and_earlier_messages_wait_in_scratch() -> None:
    w = World()
    w.send(0, 1, _t(1, 2), tag=1)
    w.send(0, 1, _t(3, 4, 5), tag=2)
    second = torch.zeros(3)
    p1 = w.ranks[1]
    assert p1.finish(w.post(1, 0, second, tag=2)) == 0
    assert second.tolist() == [3, 4, 5]
    # NCCL's receives in the sender's order: tag 1's message first, into scratch
    assert w.recvs(1) == [8, 12] and p1.book.stash_bytes == 8
    w.send(0, 1, _t(6), tag=3)
    third = torch.zeros(1)
    assert p1.finish(w.post(1, 0, third, tag=3)) == 0 and third.tolist() == [6]
    assert w.recvs(1) == [8, 12, 4], "tag 1's message was received twice"
    first = torch.zeros(2)
    assert p1.finish(w.post(1, 0, first, tag=1)) == 0
    assert first.tolist() == [1, 2] and w.recvs(1) == [8, 12, 4], "taken from the stash"
    assert p1.book.stash_bytes == 0 and w.contacts == [(0, 1), (1, 0)]


def test_receives_are_served_in_the_order_they_were_posted() -> None:
    w = World()
    a, b = torch.zeros(2), torch.zeros(2)
    ra, rb = w.post(1, 0, a), w.post(1, 0, b)  # before anything was sent
    assert w.recvs(1) == [], "no NCCL receive before its header came"
    w.send(0, 1, _t(1, 1))
    w.send(0, 1, _t(2, 2))
    p1 = w.ranks[1]
    assert p1.finish(rb) == 0 and p1.finish(ra) == 0
    assert a.tolist() == [1, 1] and b.tolist() == [2, 2]


def test_any_source_takes_the_first_header_to_arrive() -> None:
    w = World(3)
    w.send(1, 2, _t(7), tag=5)
    w.send(0, 2, _t(8), tag=5)
    got = torch.zeros(1)
    assert w.ranks[2].finish(w.post(2, -1, got, tag=5)) == 1 and got.tolist() == [7]
    assert w.ranks[2].finish(w.post(2, -1, got, tag=5)) == 0 and got.tolist() == [8]


def test_a_header_arriving_later_completes_a_posted_irecv() -> None:
    w = World()
    got = torch.zeros(2)
    r = w.post(1, 0, got, tag=3)
    p1 = w.ranks[1]
    assert not p1.done(r)
    w.send(0, 1, _t(5, 6), tag=3)
    assert p1.done(r), "is_completed reads the headers that came"
    assert p1.finish(r) == 0 and got.tolist() == [5, 6]


# --- checks before NCCL ---------------------------------------------------------------

@pytest.mark.parametrize("recv_as", ["size", "dtype"])
def test_a_mismatch_raises_before_the_nccl_receive_is_entered(recv_as: str) -> None:
    w = World()
    w.send(0, 1, _t(1, 2, 3, 4), tag=9, site="train.py:10")
    if recv_as == "size":
        r = w.post(1, 0, torch.zeros(5), tag=9, site="train.py:20")
    else:
        r = w.post(1, 0, torch.zeros(4, dtype=torch.int64), tag=9, site="train.py:20",
                   dtype=I64)
    with pytest.raises(CollectiveMismatch) as info:
        w.ranks[1].finish(r)
    text = str(info.value)
    assert "rank 0 sent float32 x 4 (tag 9) at train.py:10" in text
    assert "rank 1 received it with recv(" in text and "at train.py:20" in text
    assert w.recvs(1) == [], "the fake NCCL receive was entered"
    assert w.told == [info.value], "the job is told: the sender's data waits in NCCL"
    # the source's stream of messages is broken: a later one is refused, not mis-delivered
    w.send(0, 1, _t(1), tag=0)
    with pytest.raises(CollectiveMismatch):
        w.ranks[1].finish(w.post(1, 0, torch.zeros(1)))
    assert w.recvs(1) == []


def test_a_header_is_bounded_and_checked_as_hostile_bytes() -> None:
    h = Header(3, 7, -5, F32, 6, 24, (2, 3), "train.py:42")
    assert decode(3, encode(h)) == h
    data = encode(h)
    for bad in (data[:10], data + b"x", data[:-1]):
        with pytest.raises(DistError, match="rank 3"):
            decode(3, bad)
    w = World()
    w.boxes[1] = deque([(0, encode(Header(0, 1, 0, F32, 1, 4, (1,), "")))])
    with pytest.raises(DistError, match="#1 where #0 was next"):
        w.ranks[1].progress()


# --- bounded waits ---------------------------------------------------------------------

def test_a_send_nobody_receives_ends_in_the_watchdogs_timeout() -> None:
    w = World()
    p = w.send(0, 1, _t(1, 2))
    dog = w.dogs[0]
    dog.tick()
    assert not p.settled.is_set() and w.aborts == []
    w.clock.now += 6.0
    dog.tick()
    assert w.aborts == [0] and isinstance(p.error, DistTimeout)
    assert "timed out in send(" in str(p.error)
    with pytest.raises(DistTimeout):
        w.send(0, 1, _t(1))  # the next call on the group raises it
    with pytest.raises(DistTimeout):
        w.ranks[0].waits.order(p.call, p)


def test_a_recv_whose_send_never_comes_times_out_and_is_forgotten() -> None:
    w = World()
    w.send(0, 1, _t(1, 2), tag=0)
    r = w.post(1, 0, torch.zeros(2), tag=4)
    with pytest.raises(DistTimeout, match=r"rank 1 timed out in recv\(.*from rank 0 \(tag 4\)"
                       r".*messages from rank 0 with tags \[0\] wait for their receives"):
        w.ranks[1].finish(r)
    assert w.ranks[1].book.pending() == 0
    w.send(0, 1, _t(1, 2), tag=4)
    w.ranks[1].progress()
    assert w.recvs(1) == [], "a given-up receive took a message"


def test_a_dead_peer_fails_a_waiting_recv_and_the_works_in_flight() -> None:
    w = World()
    dead = PeerFailure("rank 0 died", rank=0)
    w.links[1].dead[0] = dead
    with pytest.raises(PeerFailure, match="rank 0 died"):
        w.ranks[1].finish(w.post(1, 0, torch.zeros(2)))
    p = w.send(1, 0, _t(1, 2))  # enqueued; nobody will receive it
    w.links[1].failed.append(dead)
    w.dogs[1].tick()
    assert p.error is dead and w.aborts == [1]


def test_the_first_op_between_two_ranks_is_bounded() -> None:
    """``bounded_enqueue``: NCCL's pair communicator blocks the enqueue until the peer
    joins; a failure releases it, the deadline aborts the group."""
    hold = threading.Event()
    aborts: list[int] = []
    try:
        assert bounded_enqueue(lambda: "work", failure=lambda: None, timeout=60.0,
                               what=lambda: "pair", on_timeout=lambda: aborts.append(1)) \
            == "work"
        dead = PeerFailure("rank 1 died", rank=1)
        with pytest.raises(PeerFailure):
            bounded_enqueue(hold.wait, failure=lambda: dead, timeout=60.0,
                            what=lambda: "pair", on_timeout=lambda: aborts.append(1))
        assert aborts == []
        with pytest.raises(DistTimeout, match="ranks 0 and 1 .* was not made within 0s"):
            bounded_enqueue(hold.wait, failure=lambda: None, timeout=0.0,
                            what=lambda: "ranks 0 and 1 (their first send/recv)",
                            on_timeout=lambda: aborts.append(1))
        assert aborts == [1]

        def broken() -> Any:
            raise RuntimeError("NCCL error: invalid usage")
        with pytest.raises(DistError, match="pair failed: NCCL error"):
            bounded_enqueue(broken, failure=lambda: None, timeout=60.0, what=lambda: "pair",
                            on_timeout=lambda: aborts.append(1))
    finally:
        hold.set()


# --- the switch and the fallback ------------------------------------------------------------

def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.api.p2p_nccl import ENV, device_p2p, enabled
    from rankwise.engines.device.pair import DevicePair

    monkeypatch.delenv(ENV, raising=False)
    assert enabled("nccl") and not enabled("nccl(gloo stand-in)")
    monkeypatch.setenv(ENV, "0")
    assert not enabled("nccl")
    monkeypatch.setenv(ENV, "1")
    assert enabled("nccl(gloo stand-in)")
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(InvalidArgument, match="RANKWISE_NCCL_P2P='yes'"):
        enabled("nccl")

    monkeypatch.setenv(ENV, "1")
    host = SimpleNamespace(name="tcp", serial=False, framed=True)
    made = SimpleNamespace(name="nccl", device=object(), p2p="the device p2p")
    pair = DevicePair(host, made)  # type: ignore[arg-type]
    tensor = SimpleNamespace(dtype=SimpleNamespace(tensor=True))
    array = SimpleNamespace(dtype=SimpleNamespace(tensor=False))
    assert device_p2p(SimpleNamespace(engine=pair), tensor) == "the device p2p"  # type: ignore[arg-type]
    assert device_p2p(SimpleNamespace(engine=pair), array) is None  # type: ignore[arg-type]
    staged = SimpleNamespace(engine=host)  # gloo/staged groups: host memory
    assert device_p2p(staged, tensor) is None  # type: ignore[arg-type]
    monkeypatch.setenv(ENV, "0")
    assert device_p2p(SimpleNamespace(engine=pair), tensor) is None  # type: ignore[arg-type]


# --- through the public API: thread-ranks, the real control plane, a fake NCCL engine ----

class FakeNcclEngine:
    """What the API and ``api.p2p_nccl`` use of the NCCL engine (``TorchEngine``): its
    name, device, waits (the real watchdog on the real control plane, CUDA-like
    streams), ``p2p_group`` and ``_abort``; the torch group is the fake net."""

    name = "nccl"

    def __init__(self, group: Any, net: FakeNet) -> None:
        from rankwise.engines.torch.wait import CommPlane, WorkWaiter

        self.p2p: Any = None
        from rankwise.engines.torch.tensors import DeviceTensors

        self.tensors = DeviceTensors(torch.device("cpu"))
        self.waiter = WorkWaiter(group.port, "nccl")
        self.aborted = 0
        self._pg = net.pg(group.comm.rank)
        plane = CommPlane(self.waiter, lambda: True)
        self.dog = Watchdog(plane, lambda: self._abort(None), name="nccl")
        self.device = DeviceWaits(self.dog, CudaLike(), plane.op_failed)
        self.dog.start()

    def p2p_group(self, src: int, dst: int) -> Any:
        return self._pg

    def _abort(self, failure: BaseException | None) -> None:
        self.aborted += 1


def _on_fake_nccl(monkeypatch: pytest.MonkeyPatch, n: int, fn: Any,
                  net: FakeNet | None = None) -> list[Any]:
    """Run ``fn(rank, engine)`` on ``n`` thread-ranks whose default group has the fake
    NCCL plane; CPU tensors take the tensor path (``RANKWISE_TENSOR_PATH``)."""
    from rankwise.api.world import resolve_group
    from rankwise.engines.device.pair import DevicePair
    from rankwise.testing.threads import run_threads
    from rankwise.wire import device

    monkeypatch.setattr(device, "CPU_TENSORS", True)
    monkeypatch.delenv("RANKWISE_NCCL_P2P", raising=False)
    if net is None:
        net = FakeNet(reads=True)

    def body(rank: int, size: int) -> Any:
        g = resolve_group(None)
        assert g is not None
        engine = FakeNcclEngine(g, net)
        g.engine = DevicePair(g.engine, engine)  # type: ignore[arg-type]
        try:
            return fn(rank, engine)
        finally:
            engine.dog.stop()
    return run_threads(body, n, timeout=30.0, op_timeout=10.0)


def test_the_api_sends_tensors_over_nccl_and_host_memory_beside_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        if r == 0:
            engine.tensors.device = torch.device("meta")  # the group's GPU: another one
            with pytest.raises(InvalidArgument, match="the tensor is on cpu, but the "
                               r"default group \(WORLD\)'s NCCL communicator is on meta"):
                dist.send(_t(1, 2), 1)
            engine.tensors.device = torch.device("cpu")
            assert not engine.p2p._sent and not net.log, "I/O before the device check"
            dist.send(_t(1, 2), 1, tag=1)
            work = dist.isend(_t(3, 4, 5), 1, tag=2)
            assert work is not None and work.wait()
            dist.send(np.array([9.0], dtype=np.float32), 1, tag=1)  # host memory, tag 1 too
            ours, theirs = _t(6), torch.zeros(1)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, 1),
                                            dist.P2POp(dist.isend, ours, 1)])
            for w in works:
                w.wait()
            return theirs.tolist(), engine.p2p is not None
        second, first, host = torch.zeros(3), torch.zeros(2), np.zeros(1, dtype=np.float32)
        assert dist.recv(second, 0, tag=2) == 0
        pending = dist.irecv(first, 0, tag=1)
        assert dist.recv(host, 0, tag=1) == 0
        assert pending is not None and pending.wait() and pending.source_rank() == 0
        ours, theirs = _t(7), torch.zeros(1)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, ours, 0),
                                        dist.P2POp(dist.irecv, theirs, 0)])
        for w in works:
            w.wait()
        return second.tolist(), first.tolist(), host.tolist(), theirs.tolist()

    net = FakeNet(reads=True)
    zero, one = _on_fake_nccl(monkeypatch, 2, rank, net)
    assert zero == ([7.0], True)
    assert one == ([3, 4, 5], [1, 2], [9.0], [6.0])


def test_the_switch_off_sends_tensors_through_host_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        monkeypatch.setenv("RANKWISE_NCCL_P2P", "0")
        if r == 0:
            dist.send(_t(1, 2), 1)
        else:
            got = torch.zeros(2)
            dist.recv(got, 0)
            return got.tolist(), engine.p2p
        return None

    assert _on_fake_nccl(monkeypatch, 2, rank)[1] == ([1, 2], None)


def test_a_mismatch_through_the_api_reaches_both_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        try:
            if r == 0:
                dist.send(_t(1, 2, 3, 4), 1)  # returns: the stream waits, not the host
                dist.recv(torch.zeros(1), 1, tag=77)  # released by rank 1's mismatch
            else:
                dist.recv(torch.zeros(5), 0)
        except CollectiveMismatch as exc:
            engine.dog.tick()  # one pass (its thread may have made it already)
            return str(exc), engine.aborted, engine.dog.failed, engine.dog.in_flight()
        return None

    (zero, aborted, failed, left), (one, *_) = _on_fake_nccl(monkeypatch, 2, rank)
    for text in (zero, one):
        assert "rank 0 sent float32 x 4 (tag 0) at" in text and "test_nccl_p2p.py" in text
        assert "rank 1 received it with recv(float32 x 5)" in text
    # the send waiting in NCCL: its group aborted, its work settled with the mismatch
    assert aborted == 1 and isinstance(failed, CollectiveMismatch) and left == 0
