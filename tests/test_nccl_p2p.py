"""Point-to-point on NCCL (issue 28), in-process with fakes: no GPU, no NCCL here.

Each rank is an ``NcclP2P`` over a fake torch group (``FakeNet``: per-direction FIFOs
that pair sends with receives in order and copy the bytes, as NCCL would, with no tags),
a fake control plane for the headers (``FakeLink``), the engine's real book with a
fake clock, and CUDA-like streams (ordering never blocks the host); see
``_nccl_p2p_fakes.py``. Asserted: messages match by (source, tag) in arrival order and
receives in post order; a header that does not fit its receive raises before the fake
NCCL receive is entered; a send nobody receives ends in the book's DistTimeout, a
dead peer in PeerFailure; the first op between two ranks is bounded; the switch and the
host fallback. No sleeps.
"""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
from _nccl_p2p_fakes import F32, I64, World, floats

from rankwise.engines.base import HOST_CAPS
from rankwise.engines.device.p2p_book import Header, decode, encode
from rankwise.engines.torch import p2p
from rankwise.engines.torch.p2p import bounded_enqueue
from rankwise.errors import CollectiveMismatch, DistError, DistTimeout, InvalidArgument, PeerFailure

torch = pytest.importorskip("torch")


# --- matching: (source, tag) in arrival order, receives in post order -------------------

def test_tags_match_in_arrival_order_and_earlier_messages_wait_in_scratch() -> None:
    w = World()
    w.send(0, 1, floats(1, 2), tag=1)
    w.send(0, 1, floats(3, 4, 5), tag=2)
    second = torch.zeros(3)
    p1 = w.ranks[1]
    assert p1.finish(w.post(1, 0, second, tag=2)) == 0
    assert second.tolist() == [3, 4, 5]
    # NCCL's receives in the sender's order: tag 1's message first, into scratch
    assert w.recvs(1) == [8, 12] and p1.book.stash_bytes == 8
    w.send(0, 1, floats(6), tag=3)
    third = torch.zeros(1)
    assert p1.finish(w.post(1, 0, third, tag=3)) == 0 and third.tolist() == [6]
    assert w.recvs(1) == [8, 12, 4], "tag 1's message was received twice"
    first = torch.zeros(2)
    assert p1.finish(w.post(1, 0, first, tag=1)) == 0
    assert first.tolist() == [1, 2] and w.recvs(1) == [8, 12, 4], "taken from the stash"
    assert p1.book.stash_bytes == 0 and w.contacts == [(0, 1), (1, 0)]
    w.send(1, 0, floats(8))  # the other direction: another torch group, bounded again
    assert w.contacts == [(0, 1), (1, 0), (1, 0)]


def test_receives_are_served_in_the_order_they_were_posted() -> None:
    w = World()
    a, b = torch.zeros(2), torch.zeros(2)
    ra, rb = w.post(1, 0, a), w.post(1, 0, b)  # before anything was sent
    assert w.recvs(1) == [], "no NCCL receive before its header came"
    w.send(0, 1, floats(1, 1))
    w.send(0, 1, floats(2, 2))
    p1 = w.ranks[1]
    assert p1.finish(rb) == 0 and p1.finish(ra) == 0
    assert a.tolist() == [1, 1] and b.tolist() == [2, 2]


def test_any_source_takes_the_first_header_to_arrive() -> None:
    w = World(3)
    w.send(1, 2, floats(7), tag=5)
    w.send(0, 2, floats(8), tag=5)
    got = torch.zeros(1)
    assert w.ranks[2].finish(w.post(2, -1, got, tag=5)) == 1 and got.tolist() == [7]
    assert w.ranks[2].finish(w.post(2, -1, got, tag=5)) == 0 and got.tolist() == [8]


def test_a_header_arriving_later_completes_a_posted_irecv() -> None:
    w = World()
    got = torch.zeros(2)
    r = w.post(1, 0, got, tag=3)
    p1 = w.ranks[1]
    assert not p1.done(r)
    w.send(0, 1, floats(5, 6), tag=3)
    assert p1.done(r), "is_completed reads the headers that came"
    assert p1.finish(r) == 0 and got.tolist() == [5, 6]


# --- checks before NCCL ---------------------------------------------------------------

@pytest.mark.parametrize("recv_as", ["size", "dtype"])
def test_a_mismatch_raises_before_the_nccl_receive_is_entered(recv_as: str) -> None:
    w = World()
    w.send(0, 1, floats(1, 2, 3, 4), tag=9, site="train.py:10")
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
    w.send(0, 1, floats(1), tag=0)
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

def test_a_send_nobody_receives_ends_in_the_books_timeout() -> None:
    w = World()
    p = w.send(0, 1, floats(1, 2))
    dog = w.dogs[0]
    dog.tick()
    assert not p.settled.is_set() and w.aborts == []
    w.clock.now += 6.0
    dog.tick()
    assert w.aborts == [0] and isinstance(p.error, DistTimeout)
    assert "timed out in send(" in str(p.error)
    with pytest.raises(DistTimeout):
        w.send(0, 1, floats(1))  # the next call on the group raises it
    with pytest.raises(DistTimeout):
        w.ranks[0].waits.order(p.call, p)


def test_a_recv_whose_send_never_comes_times_out_and_is_forgotten() -> None:
    w = World()
    w.send(0, 1, floats(1, 2), tag=0)
    r = w.post(1, 0, torch.zeros(2), tag=4)
    with pytest.raises(DistTimeout, match=r"rank 1 timed out in recv\(.*from rank 0 \(tag 4\)"
                       r".*messages from rank 0 with tags \[0\] wait for their receives"):
        w.ranks[1].finish(r)
    assert w.ranks[1].book.pending() == 0
    w.send(0, 1, floats(1, 2), tag=4)
    w.ranks[1].progress()
    assert w.recvs(1) == [], "a given-up receive took a message"


def test_a_dead_peer_fails_a_waiting_recv_and_the_works_in_flight() -> None:
    w = World()
    dead = PeerFailure("rank 0 died", rank=0)
    w.links[1].dead[0] = dead
    with pytest.raises(PeerFailure, match="rank 0 died"):
        w.ranks[1].finish(w.post(1, 0, torch.zeros(2)))
    p = w.send(1, 0, floats(1, 2))  # enqueued; nobody will receive it
    w.links[1].failed.append(dead)
    w.dogs[1].tick()
    assert p.error is dead and w.aborts == [1]


def test_the_first_op_between_two_ranks_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
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
        monkeypatch.setattr(p2p, "EXPLAIN", 0.0)
        with pytest.raises(DistError, match="pair failed: NCCL error"):
            bounded_enqueue(broken, failure=lambda: None, timeout=60.0, what=lambda: "pair",
                            on_timeout=lambda: aborts.append(1))
        # a peer that found a mismatch closed its connections before its report came: the
        # report, not the broken connection, is what this rank raises
        monkeypatch.setattr(p2p, "EXPLAIN", 30.0)
        reports: list[BaseException | None] = [None, None, dead]
        with pytest.raises(PeerFailure):
            bounded_enqueue(broken, failure=lambda: reports.pop(0) if len(reports) > 1
                            else reports[0], timeout=60.0, what=lambda: "pair",
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
    host = SimpleNamespace(name="tcp", serial=False, framed=True, caps=HOST_CAPS)
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
