"""Fakes for the NCCL p2p tests (``test_nccl_p2p.py``, ``test_nccl_p2p_api.py``): a fake
torch group with NCCL's p2p semantics, a fake control plane for the headers, CUDA-like
streams, and ``World``: n ranks' ``NcclP2P`` in one thread; ``on_fake_nccl``: thread-ranks
of the real API whose default group has a fake NCCL engine."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from rankwise.engines.torch.device_waits import DeviceWaits
from rankwise.engines.torch.engine import TorchEngine
from rankwise.engines.torch.p2p import NcclP2P
from rankwise.engines.torch.streams import CudaStreams, Streams
from rankwise.engines.torch.work_book import WorkBook
from rankwise.errors import DistError, DistTimeout
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
    inline: list[Any] | None = None  #: ``engines.base.Call.inline``

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
        self.dogs = [WorkBook(Plane(link), lambda r=r: self.aborts.append(r),  # type: ignore[misc]
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
        return Call(Fingerprint(int(op), dtype, 0, 0, 0, t.numel()), self.clock.now + 5.0, site)

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


def floats(*values: float) -> Any:
    return torch.tensor(values, dtype=torch.float32)


class FakeNcclEngine:
    """What ``TorchEngine.make_p2p`` and the API use of the NCCL engine: its group,
    name, device, waits (the real work book on the real control plane, CUDA-like
    streams), ``p2p_group`` and ``_abort``; the torch group is the fake net."""

    name = "nccl"
    #: the engine's own assembly of its p2p, over the fake's parts
    make_p2p = TorchEngine.make_p2p

    def __init__(self, group: Any, net: FakeNet) -> None:
        from rankwise.engines.torch.device_waits import CommPlane
        from rankwise.engines.torch.host_wait import WorkWaiter

        self.group = group
        self.p2p: Any = None
        from rankwise.engines.torch.tensors import DeviceTensors

        self.tensors = DeviceTensors(torch.device("cpu"))
        self.waiter = WorkWaiter(group.port, "nccl")
        self.aborted = 0
        self._pg = net.pg(group.comm.rank)
        plane = CommPlane(self.waiter, lambda: True)
        self.dog = WorkBook(plane, lambda: self._abort(None), name="nccl")
        self.device = DeviceWaits(self.dog, CudaLike(), plane.op_failed)
        self.dog.start()

    def p2p_group(self, src: int, dst: int) -> Any:
        return self._pg

    def _abort(self, failure: BaseException | None) -> None:
        self.aborted += 1


def on_fake_nccl(monkeypatch: pytest.MonkeyPatch, n: int, fn: Any,
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
