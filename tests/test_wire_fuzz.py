"""Hostile bytes (issue 2: "nothing unauthenticated is trusted"; item 2: "a malformed
client is dropped and the server keeps serving the others").

Seeded random loops (hypothesis is not a dependency), bounded in count and time:
- the frame-header decoder raises only ``WireError`` and never accepts an absurd length;
- the safe object decoder raises only ``InvalidArgument`` on truncated/mutated messages;
- a running 2-rank job's store survives garbage from a third process (before and after
  the handshake, oversized length prefixes, half frames, an idle connection) and the job
  carries on: store operations and collectives still work.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest

import rankwise as dist
from rankwise.testing import free_port, run_ranks
from rankwise.wire import frames as _wire
from rankwise.wire.frames import HEADER, MAX_CONTROL_PAYLOAD, MAX_PAYLOAD, Kind, Op, WireError
from rankwise.wire.serialize import dumps, loads

SEED = int(os.environ.get("RANKWISE_FUZZ_SEED", "20240611"))


def _valid_header(rng: random.Random) -> bytes:
    kind = rng.choice(list(Kind))
    payload = rng.choice([0, 1, 56, 4096, 1 << 20])
    return _wire.encode_header(kind, group=rng.getrandbits(32), seq=rng.getrandbits(63),
                               op=rng.choice(list(Op)), dtype=rng.getrandbits(8),
                               reduce=rng.getrandbits(8), flags=rng.choice([0, *_wire.Flag]),
                               root=rng.randrange(-1, 64),
                               count=rng.randrange(-1, 1 << 40), tag=rng.randrange(-(1 << 62),
                                                                                  1 << 62),
                               site=rng.getrandbits(32), step=rng.getrandbits(32),
                               payload_len=payload)


def _check_decoded(frame: _wire.Frame) -> None:
    assert frame.kind in {int(k) for k in Kind}, frame
    assert frame.op in {int(o) for o in Op}, frame
    assert 0 <= frame.payload_len <= MAX_PAYLOAD, frame
    if frame.kind not in (Kind.COLL, Kind.P2P, Kind.OBJ):
        assert frame.payload_len <= MAX_CONTROL_PAYLOAD, frame
    assert frame.count >= -1, frame
    assert frame.flags & ~(_wire.CALL_FLAGS | _wire.LANE_FLAGS) == 0, frame


def test_decode_header_only_raises_wire_error() -> None:
    rng = random.Random(SEED)
    accepted = rejected = 0
    deadline = time.monotonic() + 10.0
    for i in range(30_000):
        if time.monotonic() > deadline:
            break
        mode = i % 5
        if mode == 0:  # random bytes of random length (mostly the wrong length)
            data = rng.randbytes(rng.choice([0, 1, 55, 56, 57, 112, rng.randrange(200)]))
        elif mode == 1:  # right length, random content
            data = rng.randbytes(HEADER.size)
        elif mode == 2:  # a valid header with a few random bytes flipped
            buf = bytearray(_valid_header(rng))
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] = rng.getrandbits(8)
            data = bytes(buf)
        elif mode == 3:  # a valid header with an absurd or negative field
            fields = list(HEADER.unpack(_valid_header(rng)))
            idx = rng.choice([2, 5, 8, 9, 10, 14])  # kind, op, flags, root, count, payload_len
            fmt = HEADER.format[1:][idx]
            lo, hi = {"B": (0, 255), "i": (-(2**31), 2**31 - 1), "q": (-(2**63), 2**63 - 1),
                      "Q": (0, 2**64 - 1)}[fmt]
            fields[idx] = rng.choice([lo, hi, lo + 1, hi - 1, rng.randint(lo, hi)])
            data = HEADER.pack(*fields)
        else:  # valid headers (must decode) as a control group
            data = _valid_header(rng)
        try:
            frame = _wire.decode_header(data)
        except WireError:
            rejected += 1
            continue
        except Exception as exc:
            raise AssertionError(f"decode_header({data!r}) raised {exc!r}") from exc
        _check_decoded(frame)
        accepted += 1
    assert accepted > 1000 and rejected > 1000, (accepted, rejected)


def test_decode_header_limits_are_exact() -> None:
    base = {"group": 1, "seq": 1, "op": int(Op.all_reduce)}
    ok = _wire.decode_header(_wire.encode_header(Kind.COLL, payload_len=MAX_PAYLOAD, **base))
    assert ok.payload_len == MAX_PAYLOAD
    for kind, n in ((Kind.COLL, MAX_PAYLOAD + 1), (Kind.P2P, 2**64 - 1),
                    (Kind.ABORT, MAX_CONTROL_PAYLOAD + 1), (Kind.SITE, MAX_CONTROL_PAYLOAD + 1),
                    (Kind.HERE, 1 << 40)):
        try:
            _wire.decode_header(_wire.encode_header(kind, payload_len=n, **base))
        except WireError as exc:
            assert "exceeds" in str(exc)
        else:
            raise AssertionError(f"{kind.name} frame claiming {n} bytes was accepted")
    for bad in (struct.pack("<H", 0x1234) + bytes(54), bytes(56),
                _wire.encode_header(Kind.COLL, count=-2, **base)):
        try:
            _wire.decode_header(bad)
        except WireError:
            pass
        else:
            raise AssertionError(f"accepted {bad!r}")


def test_object_decoder_only_raises_invalid_argument() -> None:
    rng = random.Random(SEED + 1)
    samples = [None, True, 3, -(2**80), 1.5, 2j, "héllo", b"\x00\xff", [1, [2, (3,)]],
               {"a": {1, 2}, "b": frozenset([b"x"])}, {"arr": np.arange(6).reshape(2, 3)},
               [np.zeros(3, np.float16), np.ones((2, 2), bool)], ["x" * 300] * 3]
    blobs = [dumps(s) for s in samples]
    for blob in blobs:  # the control group round-trips
        loads(blob)
    deadline = time.monotonic() + 8.0
    tried = 0
    for i in range(20_000):
        if time.monotonic() > deadline:
            break
        blob = bytearray(rng.choice(blobs))
        mode = i % 4
        if mode == 0:
            blob = blob[:rng.randrange(len(blob))]  # truncated
        elif mode == 1:
            for _ in range(rng.randrange(1, 4)):
                blob[rng.randrange(len(blob))] = rng.getrandbits(8)
        elif mode == 2:  # a length-looking u32 set to something huge
            pos = rng.randrange(max(1, len(blob) - 4))
            blob[pos:pos + 4] = struct.pack("<I", rng.choice([2**32 - 1, 2**31, 1 << 24]))
        else:
            blob = bytearray(b"S" + rng.randbytes(rng.randrange(64)))
        tried += 1
        try:
            loads(bytes(blob), False, "rank 9")
        except dist.InvalidArgument:
            pass
        except Exception as exc:
            raise AssertionError(f"loads({bytes(blob)!r}) raised {exc!r}") from exc
    assert tried > 1000


def test_object_decoder_known_leaks() -> None:
    bad_utf8 = b"Ss\x01\x00\x00\x00\xff"
    ragged = (b"Sa\x03\x00\x00\x00<i8\x01\x00\x00\x00" + struct.pack("<q", 1)
              + struct.pack("<Q", 3) + b"abc")
    for blob in (bad_utf8, ragged):
        try:
            loads(blob, False, "rank 9")
        except dist.InvalidArgument as exc:
            assert "rank 9" in str(exc)
        else:
            raise AssertionError(f"accepted {blob!r}")


# --- garbage at a live job's store -------------------------------------------------------


def _hostile_clients(port: int, marker: str, report: list[str]) -> None:
    """From the test process (a third party), throw garbage at the store at ``port``."""
    from rankwise.store.protocol import Op as SOp
    from rankwise.wire.auth import client_handshake

    rng = random.Random(SEED + 2)
    deadline = time.monotonic() + 15
    idle: list[socket.socket] = []

    def connect() -> socket.socket:
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.settimeout(2)
                return s
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def attempt(payload: bytes, handshake: bool, half_close: bool = False) -> None:
        s = connect()
        try:
            if handshake:
                client_handshake(s, None, "store", "fuzz")
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            try:
                s.recv(4096)  # a reply or the server's close, never a hang (2 s bound)
            except OSError:
                pass
        except OSError as exc:
            report.append(f"note: {exc!r}")
        except dist.DistError as exc:
            report.append(f"handshake refused: {exc!r}")
        finally:
            s.close()

    try:
        for _ in range(6):  # not even the handshake
            attempt(rng.randbytes(rng.randrange(1, 300)), handshake=False)
        attempt(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", handshake=False)
        frames = [
            struct.pack("!BH", 99, 1) + struct.pack("!I", 3) + b"abc",  # unknown op
            struct.pack("!BH", int(SOp.SET), 2) + struct.pack("!I", 2**32 - 1),  # huge key
            struct.pack("!BH", int(SOp.SET), 2) + struct.pack("!I", 1) + b"k"
            + struct.pack("!I", 2**31),  # value length far over the limit
            struct.pack("!BH", int(SOp.WAIT), 65535),  # too many keys
            struct.pack("!BH", int(SOp.GET), 1) + struct.pack("!I", 100) + b"short",  # half
            struct.pack("!BH", int(SOp.ADD), 2) + struct.pack("!I", 1) + b"k"
            + struct.pack("!I", 3) + b"xyz",  # malformed int
        ]
        for f in frames:
            attempt(f, handshake=True, half_close=True)
        for _ in range(6):
            attempt(rng.randbytes(rng.randrange(1, 200)), handshake=True)
        for _ in range(2):  # idle connections held open while the job goes on
            s = connect()
            client_handshake(s, None, "store", "fuzz")
            idle.append(s)
    except Exception as exc:  # noqa: BLE001
        report.append(f"sender failed: {exc!r}")
    finally:
        with open(marker, "w") as f:
            f.write("done")
    time.sleep(3)
    for s in idle:
        s.close()


def _job_after_garbage(rank: int, world: int, port: int, marker: str) -> Any:
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=10.0)
    deadline = time.monotonic() + 20
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise TimeoutError("the hostile sender never finished")
        time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=5.0)
    store.set(f"after/{rank}", str(rank * 7))
    total = store.add("after/count", 1)
    store.wait([f"after/{r}" for r in range(world)])
    seen = [store.get(f"after/{r}").decode() for r in range(world)]
    a = np.full(8, rank + 1.0, np.float32)
    dist.all_reduce(a)
    sub = dist.new_group([0, 1])
    dist.barrier(group=sub)
    store.close()
    return seen, a.tolist(), int(total)


@pytest.mark.procs
def test_store_survives_garbage_and_the_job_goes_on(tmp_path: Any) -> None:
    port = free_port()
    marker = str(tmp_path / "garbage-sent")
    report: list[str] = []
    sender = threading.Thread(target=_hostile_clients, args=(port, marker, report), daemon=True)
    sender.start()
    results = run_ranks(_job_after_garbage, 2, args=(port, marker), init=False, timeout=60)
    sender.join(10)
    assert not any(r.startswith("sender failed") for r in report), report
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        seen, summed, total = r.value
        assert seen == ["0", "7"] and summed == [3.0] * 8 and total in (1, 2), r.value


def test_decode_checks_only_raises_wire_error() -> None:
    """A ``Kind.CHECKS`` payload (batched ring-check fingerprints) is hostile bytes too:
    every entry it yields is a valid empty collective frame of the carrier's group, step
    and sender, and anything else is a ``WireError``."""
    rng = random.Random(SEED)
    carrier = _wire.decode_header(_wire.encode_header(Kind.CHECKS, group=7, step=5,
                                                      payload_len=0), 0, 3)
    size = _wire.CHECK_ENTRY.size
    accepted = rejected = 0
    for i in range(5_000):
        if i % 2:
            payload = rng.randbytes(rng.choice([size, 2 * size, rng.randrange(4 * size)]))
        else:
            payload = b"".join(_wire.CHECK_ENTRY.pack(
                rng.getrandbits(64), rng.choice(list(Op)), rng.getrandbits(8),
                rng.getrandbits(8), rng.choice([_wire.Flag.CHECK, _wire.Flag.CHECK | 1]),
                rng.randint(-5, 5), rng.randint(-1, 1 << 40),
                rng.getrandbits(32)) for _ in range(rng.randrange(1, 4)))
        try:
            frames = _wire.decode_checks(carrier, payload)
        except WireError:
            rejected += 1
            continue
        assert len(frames) * size == len(payload)
        for f in frames:
            _check_decoded(f)
            assert (f.kind, f.group, f.step, f.src, f.payload_len) == \
                (Kind.COLL, 7, 5, 3, 0), f
        accepted += 1
    assert accepted > 1000 and rejected > 1000, (accepted, rejected)
