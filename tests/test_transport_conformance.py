"""The ``Transport`` contract, checked against every transport (tcp, shm and memory).

Why one suite: the layers above a transport (router, checks, algorithms) assume exactly
these properties — whole frames, per-sender order, correct source, loss reported once,
sends after close refused — and a new transport is only done when it passes all of them
(trio's ``check_two_way_stream`` plays this role for trio's streams).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _loopback import connected_pair
from _transports import WAIT, Recorder, lazy_tcp_world, shm_world, start_all

from rankwise.errors import DistNetworkError
from rankwise.transport.memory import MemoryHub
from rankwise.transport.per_peer import PerPeerTransport
from rankwise.transport.tcp import TcpTransport
from rankwise.wire.frames import DROP, HOLD, Kind, encode_header


def _tcp_world(n: int) -> list[Any]:
    """n TcpTransports fully connected over loopback sockets (no rendezvous needed)."""
    socks: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            accepted, client = connected_pair()
            socks[a][b], socks[b][a] = client, accepted
    return [TcpTransport(r, n, socks[r]) for r in range(n)]


def _lazy_tcp_world(n: int) -> list[Any]:
    """n TcpTransports that connect on demand, every pair connected at once from both
    ends (so some pairs share one connection and some race to two)."""
    world = lazy_tcp_world(n)
    deadline = time.monotonic() + WAIT
    threads = [threading.Thread(target=world[a].open_to, args=(b, deadline))
               for a in range(n) for b in range(n) if a != b]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert all(world[a].connected() == set(range(n)) - {a} for a in range(n))
    return world


def _memory_world(n: int) -> list[Any]:
    return list(MemoryHub(n).transports)


def _per_peer_world(n: int) -> list[Any]:
    """Each rank reaches half its peers over shared memory and half over tcp (routes are
    symmetric, as the transport factory makes them)."""
    shm, tcp = shm_world(n), _tcp_world(n)
    return [PerPeerTransport(r, n, {p: (shm[r] if (r + p) % 2 else tcp[r])
                                    for p in range(n) if p != r}, [shm[r], tcp[r]])
            for r in range(n)]


WORLDS = {"tcp": _tcp_world, "tcp-lazy": _lazy_tcp_world, "memory": _memory_world,
          "shm": shm_world, "per-peer": _per_peer_world}


@pytest.fixture(params=sorted(WORLDS))
def world(request: pytest.FixtureRequest) -> Iterator[Callable[[int], tuple[list[Any],
                                                                           list[Recorder]]]]:
    made: list[Any] = []

    def make(n: int) -> tuple[list[Any], list[Recorder]]:
        transports = WORLDS[request.param](n)
        made.extend(transports)
        return transports, start_all(transports)

    yield make
    for t in made:
        t.close()


def _frame(tag: int, payload: bytes, kind: Kind = Kind.P2P) -> tuple[bytes, bytes]:
    return encode_header(kind, tag=tag, payload_len=len(payload)), payload


def test_frames_arrive_whole_in_order_with_their_source(world: Any) -> None:
    transports, recs = world(3)
    sizes = [0, 1, 7, 4096, 70_000, 3 << 20]  # empty, small, staged, direct-read sizes
    for i, n in enumerate(sizes):
        header, payload = _frame(i, bytes([i % 251]) * n)
        transports[1].send(0, header, payload, time.monotonic() + WAIT)
    recs[0].wait_for(lambda: len(recs[0].frames) == len(sizes))
    for i, (frame, payload) in enumerate(recs[0].frames):
        assert frame.src == 1 and frame.tag == i and frame.kind == Kind.P2P
        assert payload == bytes([i % 251]) * sizes[i]
    assert not recs[2].frames  # nothing leaks to a rank it was not sent to


def test_sender_may_reuse_its_buffer_once_send_returns(world: Any) -> None:
    transports, recs = world(2)
    buf = bytearray(b"a" * 100_000)
    header, _ = _frame(5, bytes(buf))
    transports[0].send(1, header, memoryview(buf), time.monotonic() + WAIT)
    buf[:] = b"b" * len(buf)
    recs[1].wait_for(lambda: len(recs[1].frames) == 1)
    assert recs[1].frames[0][1] == b"a" * 100_000


def test_concurrent_senders_never_interleave_frames(world: Any) -> None:
    transports, recs = world(2)
    per_thread, threads = 50, 4

    def blast(k: int) -> None:
        for i in range(per_thread):
            header, payload = _frame(k * 1000 + i, bytes([k]) * (1000 + 37 * i))
            transports[0].send(1, header, payload, time.monotonic() + WAIT)

    workers = [threading.Thread(target=blast, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT)
    recs[1].wait_for(lambda: len(recs[1].frames) == per_thread * threads)
    seen: dict[int, list[int]] = {}
    for frame, payload in recs[1].frames:
        k, i = divmod(frame.tag, 1000)
        assert payload == bytes([k]) * (1000 + 37 * i)  # whole, not mixed with another
        seen.setdefault(k, []).append(i)
    assert all(order == list(range(per_thread)) for order in seen.values())


def test_a_closed_peer_is_reported_to_the_others_after_its_frames(world: Any) -> None:
    transports, recs = world(3)
    header, payload = _frame(1, b"last words")
    transports[2].send(0, header, payload, time.monotonic() + WAIT)
    transports[2].close()
    for r in (0, 1):
        recs[r].wait_for(lambda r=r: any(rank == 2 for rank, _ in recs[r].lost))
    assert recs[0].frames and recs[0].frames[0][1] == b"last words"


def test_send_to_a_closed_peer_or_after_close_is_refused(world: Any) -> None:
    transports, recs = world(2)
    transports[1].close()
    recs[0].wait_for(lambda: bool(recs[0].lost))
    header, payload = _frame(0, b"x" * 10)
    with pytest.raises(DistNetworkError):
        for _ in range(100):  # tcp may buffer a send or two before the reset shows
            transports[0].send(1, header, payload, time.monotonic() + WAIT)
    transports[0].close()
    with pytest.raises(DistNetworkError):
        transports[0].send(1, header, payload, time.monotonic() + WAIT)


def test_garbage_bytes_drop_the_connection_not_the_receiver(world: Any) -> None:
    transports, recs = world(3)
    bad = bytearray(_frame(0, b"")[0])
    bad[0] ^= 0xFF  # wrong magic
    try:
        transports[1].send(0, bytes(bad), None, time.monotonic() + WAIT)
    except ValueError:
        pass  # a transport may refuse to send it at all: fine too
    else:
        recs[0].wait_for(lambda: any(rank == 1 for rank, _ in recs[0].lost))
    header, payload = _frame(9, b"still fine")
    transports[2].send(0, header, payload, time.monotonic() + WAIT)
    recs[0].wait_for(lambda: any(f.src == 2 for f, _ in recs[0].frames))


def test_a_dropped_payload_is_skipped_whole(world: Any) -> None:
    transports, recs = world(2)
    recs[1].answers[1] = DROP
    for tag, n in ((1, 3 << 20), (2, 10), (1, 100), (3, 70_000)):
        header, payload = _frame(tag, bytes([tag]) * n)
        transports[0].send(1, header, payload, time.monotonic() + WAIT)
    recs[1].wait_for(lambda: len(recs[1].frames) == 2)
    assert [(f.tag, p) for f, p in recs[1].frames] == [(2, b"\x02" * 10),
                                                       (3, b"\x03" * 70_000)]


def test_hold_pauses_one_sender_in_order_until_resume(world: Any) -> None:
    transports, recs = world(3)
    rec = recs[0]
    rec.answers[10] = HOLD
    for tag in (10, 11, 12):  # from rank 1: the first is held, the rest must wait
        header, payload = _frame(tag, bytes([tag]) * 5000)
        transports[1].send(0, header, payload, time.monotonic() + WAIT)
    rec.wait_for(lambda: 10 in rec.offered)
    header, payload = _frame(20, b"other sender")
    transports[2].send(0, header, payload, time.monotonic() + WAIT)
    rec.wait_for(lambda: any(f.tag == 20 for f, _ in rec.frames))  # not blocked by rank 1
    assert not any(f.src == 1 for f, _ in rec.frames)
    with rec.cv:
        del rec.answers[10]
    transports[0].resume(1)
    rec.wait_for(lambda: len(rec.frames) == 4)
    assert [f.tag for f, _ in rec.frames if f.src == 1] == [10, 11, 12]
    assert all(p == bytes([f.tag]) * 5000 for f, p in rec.frames if f.src == 1)


def test_two_threads_never_both_drive(world: Any) -> None:
    """Misuse: a second thread asking to read while one already does is told no (a
    transport whose own thread always reads says no to both)."""
    transports, _ = world(2)
    answers: list[bool] = []

    def ask() -> None:
        answers.append(transports[0].drive_begin())

    first = threading.Thread(target=ask)
    first.start()
    first.join(WAIT)
    second = threading.Thread(target=ask)
    second.start()
    second.join(WAIT)
    assert len(answers) == 2 and not all(answers), answers
    transports[0].drive_end()  # (a thread that does not drive: no effect)


def test_a_send_racing_close_is_refused_or_done_never_hung(world: Any) -> None:
    """Misuse: one thread sends while another closes the transport; each send either
    goes out or raises DistNetworkError, and close returns."""
    transports, _ = world(2)
    header, payload = _frame(0, b"y" * 64)
    errors: list[BaseException] = []
    started = threading.Event()

    def sender() -> None:
        started.set()
        try:
            for _ in range(10_000):
                transports[0].send(1, header, payload, time.monotonic() + WAIT)
        except DistNetworkError:
            return
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    t = threading.Thread(target=sender)
    t.start()
    assert started.wait(WAIT)
    transports[0].close()
    t.join(WAIT)
    assert not t.is_alive(), "a send hung across close"
    assert not errors, errors

