"""What only the shared-memory transport has to get right (the shared contract is in
``test_transport_conformance.py``): frames much larger than a ring, a peer killed by
SIGKILL, nothing left in /dev/shm, and ring bytes that a broken or hostile peer wrote."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from _transports import WAIT, Recorder, shm_world

from rankwise.errors import DistNetworkError
from rankwise.testing import run_ranks
from rankwise.wire.frames import HEADER, Kind, encode_header

SMALL_RING = 1 << 16


def _send(t: Any, dst: int, tag: int, payload: bytes) -> None:
    header = encode_header(Kind.P2P, tag=tag, payload_len=len(payload))
    t.send(dst, header, payload, time.monotonic() + WAIT)


def test_frames_larger_than_the_ring_stream_both_ways_at_once() -> None:
    """Both ranks send 8 MiB frames through 64 KiB rings at the same time: each sender
    waits for room its peer's reader makes, so this deadlocks if a waiting sender ever
    stopped the reading, and corrupts data if a wrap or a piece boundary were wrong."""
    transports = shm_world(2, ring_bytes=SMALL_RING)
    recs = [Recorder() for _ in transports]
    try:
        for t, rec in zip(transports, recs):
            t.start(rec)
        blobs = {r: bytes(range(256)) * (32768 + 13 * r) for r in (0, 1)}  # ~8 MiB, odd
        senders = [threading.Thread(target=_send, args=(transports[r], 1 - r, r, blobs[r]))
                   for r in (0, 1)]
        for s in senders:
            s.start()
        for s in senders:
            s.join(WAIT)
        for r in (0, 1):
            recs[r].wait_for(lambda r=r: len(recs[r].frames) == 1)
            frame, payload = recs[r].frames[0]
            assert frame.src == 1 - r and payload == blobs[1 - r]
    finally:
        for t in transports:
            t.close()


def test_an_impossible_ring_position_drops_that_peer_naming_it() -> None:
    """A peer that writes HEAD beyond what the ring can hold is a protocol error naming
    it (never a huge read); its sends fail afterwards, other peers go on."""
    transports = shm_world(3)
    recs = [Recorder() for _ in transports]
    try:
        for t, rec in zip(transports, recs):
            t.start(rec)
        ring = transports[0]._in[1].ring  # the ring rank 1 writes for rank 0
        transports[1]._w[ring.head] = (1 << 40) + 5
        transports[1]._ring_bell(0)
        recs[0].wait_for(lambda: any(r == 1 for r, _ in recs[0].lost))
        reason = next(e for r, e in recs[0].lost if r == 1)
        assert isinstance(reason, DistNetworkError)
        assert "rank 1" in str(reason) and "impossible ring position" in str(reason)
        with pytest.raises(DistNetworkError, match="closed"):
            _send(transports[1], 0, 1, b"more")
        _send(transports[2], 0, 2, b"still fine")
        recs[0].wait_for(lambda: any(f.src == 2 for f, _ in recs[0].frames))
    finally:
        for t in transports:
            t.close()


def test_a_corrupt_header_in_the_ring_drops_that_peer_naming_it() -> None:
    transports = shm_world(2)
    recs = [Recorder() for _ in transports]
    try:
        for t, rec in zip(transports, recs):
            t.start(rec)
        bad = bytearray(encode_header(Kind.P2P, tag=1, payload_len=4))
        bad[2] ^= 0x7F  # the version byte
        out = transports[1]._out[0]
        out.ring.put(out.head, memoryview(bytes(bad) + b"data"))
        transports[1]._publish(out, out.head + HEADER.size + 4)
        recs[0].wait_for(lambda: bool(recs[0].lost))
        rank, reason = recs[0].lost[0]
        assert rank == 1 and "rank 1" in str(reason) and "not a valid rankwise frame" in \
            str(reason)
        assert not recs[0].frames
    finally:
        for t in transports:
            t.close()


# --- real processes -----------------------------------------------------------------------

def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("rankwise")} \
        if os.path.isdir("/dev/shm") else set()


def w_killed_peer(rank: int, size: int, store_path: str) -> Any:
    """Rank 1 sends one frame, then SIGKILLs itself; rank 0 returns how long after that
    frame it was told rank 1 was lost, why, and how a send to rank 1 then failed."""
    from rankwise.store import FileStore
    from rankwise.transport.shm import ShmTransport

    store = FileStore(store_path, size, timeout=WAIT)
    t = ShmTransport.open(store, "ring", rank, size, list(range(size)), WAIT)
    rec = Recorder()
    t.start(rec)
    if rank == 1:
        _send(t, 0, 7, b"last words")
        os.kill(os.getpid(), signal.SIGKILL)
    rec.wait_for(lambda: bool(rec.frames))
    got = time.monotonic()
    rec.wait_for(lambda: bool(rec.lost))
    took = time.monotonic() - got
    rank_lost, reason = rec.lost[0]
    try:
        _send(t, 1, 8, b"x" * (8 << 20))  # more than its ring holds: would wait
        refused = ""
    except DistNetworkError as exc:
        refused = str(exc)
    t.close()
    return took, rank_lost, str(reason), rec.frames[0][1], refused


@pytest.mark.parametrize("method", ["memfd", "file"])
@pytest.mark.procs
def test_a_sigkilled_peer_is_reported_within_seconds_and_leaves_nothing(
        method: str, tmp_path: Any) -> None:
    before = _shm_entries()
    results = run_ranks(w_killed_peer, 2, args=(str(tmp_path / "store"),), init=False,
                        timeout=60, env={"RANKWISE_SHM_METHOD": method})
    assert results[1].exitcode == -signal.SIGKILL
    assert results[0].ok, results[0].traceback or results[0].message
    after_frame, lost, reason, payload, refused = results[0].value
    assert payload == b"last words"  # what it sent before dying still arrives
    assert lost == 1 and "rank 1" in reason and "died" in reason
    assert after_frame < 2.0  # liveness is checked every 0.1 s
    assert "rank 1" in refused  # a send to the dead peer fails, it does not wait
    assert not _shm_entries() - before, f"left in /dev/shm: {_shm_entries() - before}"
