"""Bounded receive buffering (issue 12, item 3).

- Messages nobody has asked for yet are parked only up to a cap per peer and in total
  (``RANKWISE_PARKED_PER_PEER`` / ``RANKWISE_PARKED_TOTAL``): past it the receiver stops
  reading that peer, TCP flow control blocks the sender, and the sender's wait is bounded
  by its deadline and says why. An honest flood completes once the receiver drains.
- A frame claiming more bytes than the call it belongs to can hold is a protocol error
  naming the sender; a 1 TiB claim is never allocated.
- The I/O thread never dies silently: an exception in it fails every waiter with a
  ``DistError`` that says what happened.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from _loopback import connected_pair

import rankwise as dist
from rankwise.api import world as _world
from rankwise.core.communicator import Communicator
from rankwise.testing import run_ranks
from rankwise.transport.tcp import TcpTransport
from rankwise.wire.frames import Kind, Op, encode_header

MIB = 1 << 20
CAPS = {"RANKWISE_PARKED_PER_PEER": str(16 * MIB), "RANKWISE_PARKED_TOTAL": str(32 * MIB)}
FLOOD = 300


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _flood(rank: int, world: int, drain: bool) -> Any:
    store = _world.current().store
    if rank == 0:
        msg = np.zeros(MIB // 4, np.float32)
        sent = 0
        try:
            for i in range(FLOOD):
                msg[:] = i
                dist.send(msg, dst=1, tag=7)
                sent += 1
        finally:
            store.set("sent", str(sent))
        return sent
    base = _rss()
    if drain:
        time.sleep(4.0)  # the sender runs into the cap meanwhile
    else:
        store.wait(["sent"], 60.0)
    grown = _rss() - base
    got: Any = 0
    if not drain:  # a receive that cannot be met says why this rank stopped reading
        try:
            dist.recv(np.zeros(1, np.float32), src=0, tag=99)
        except dist.DistTimeout as exc:
            got = str(exc)
    if drain:
        out = np.empty(MIB // 4, np.float32)
        for i in range(FLOOD):
            dist.recv(out, src=0, tag=7)
            assert out[0] == i and out[-1] == i, (i, out[0], out[-1])
            got += 1
    return grown, got


@pytest.mark.procs
def test_flood_of_unreceived_sends_is_bounded_and_completes_once_drained() -> None:
    results = run_ranks(_flood, 2, args=(True,), timeout=120, env=CAPS,
                        init_kwargs={"timeout": 60.0})
    for r in results:
        assert r.ok, r.message + r.traceback
    grown, got = results[1].value
    assert got == FLOOD and results[0].value == FLOOD
    assert grown < 16 * MIB + 40 * MIB, f"receiver grew by {grown / MIB:.0f} MiB"


@pytest.mark.procs
def test_flood_sender_times_out_clearly_when_nobody_receives() -> None:
    results = run_ranks(_flood, 2, args=(False,), timeout=120, env=CAPS,
                        init_kwargs={"timeout": 4.0})
    sender, receiver = results
    assert sender.raised("DistTimeout"), sender.message + sender.traceback
    assert "rank 1" in sender.message and "not reading" in sender.message, sender.message
    assert receiver.ok, receiver.message + receiver.traceback
    grown, note = receiver.value
    assert "stopped reading rank(s) [0]" in note and "RANKWISE_PARKED_PER_PEER" in note, note
    assert grown < 16 * MIB + 40 * MIB, f"receiver grew by {grown / MIB:.0f} MiB"


def _huge_claim(rank: int, world: int, kind: str) -> Any:
    comm = _world.current().comm
    g = _world.current().default_group
    if rank == 1:
        if kind == "p2p":
            header = encode_header(Kind.P2P, group=g.id, tag=5, payload_len=1 << 40)
        else:
            header = encode_header(Kind.COLL, g.id, g.seq + 1, int(Op.all_reduce), 1, 1, 0, 0,
                                   4, 0, 0, 1, 1 << 40)
        comm.transport.send(0, header, None, time.monotonic() + 5)
    if kind == "p2p":
        if rank == 0:
            dist.recv(np.zeros(4, np.float32), src=1, tag=5)
        else:
            time.sleep(3.0)
        return "returned"
    dist.all_reduce(np.ones(4, np.float32))
    return "returned"


@pytest.mark.procs
def test_one_tib_p2p_claim_is_refused_not_allocated() -> None:
    results = run_ranks(_huge_claim, 2, args=("p2p",), timeout=60,
                        init_kwargs={"timeout": 10.0})
    r = results[0]
    assert r.raised("DistError") and not r.raised("DistTimeout"), r.message + r.traceback
    assert "rank 1" in r.message and str(1 << 40) in r.message, r.message
    assert r.elapsed < 5.0, r.elapsed


@pytest.mark.procs
def test_collective_frame_larger_than_its_call_is_a_protocol_error() -> None:
    # collective frames exist only on the message engine (shm moves no frames)
    results = run_ranks(_huge_claim, 2, args=("coll",), timeout=60,
                        init_kwargs={"timeout": 10.0}, env={"RANKWISE_ENGINE": "tcp"})
    r = results[0]
    assert r.raised("DistError") and not r.raised("DistTimeout"), r.message + r.traceback
    assert "rank 1" in r.message and str(1 << 40) in r.message, r.message
    assert "at most 16 bytes" in r.message and not r.raised("CollectiveMismatch"), r.message
    assert r.elapsed < 5.0, r.elapsed
    # (rank 1, the corrupt sender, may finish its all_reduce: rank 0's frame was sound)


def test_an_exception_in_the_io_thread_fails_every_waiter() -> None:
    a, b = connected_pair()
    comm = Communicator(0, 2, TcpTransport(0, 2, {1: a}))
    try:
        def boom(frame: Any) -> Any:
            raise RuntimeError("boom in the handler")

        comm.router.on_header = boom  # type: ignore[method-assign]
        pending = comm.router.post_p2p(Kind.P2P, 0, 1, 0, memoryview(bytearray(4)))
        b.sendall(encode_header(Kind.P2P, payload_len=4) + b"abcd")
        try:
            pending.wait(time.monotonic() + 5.0, lambda: "timed out")
        except dist.DistTimeout as exc:
            raise AssertionError("the I/O thread died silently") from exc
        except dist.DistError as exc:
            assert "I/O thread" in str(exc) and "boom in the handler" in str(exc), str(exc)
            assert "rank 0" in str(exc)
        else:
            raise AssertionError("the wait succeeded")
        later = comm.router.post_p2p(Kind.P2P, 0, 1, 0, memoryview(bytearray(4)))
        assert later.completed and isinstance(later.error, dist.DistError)
    finally:
        comm.closed = True
        comm.transport.close()
        b.close()
