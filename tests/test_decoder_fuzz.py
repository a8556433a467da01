"""Hostile bytes at every decoder (issue 12, item 7): the frame reader of a live transport,
the store protocol and the object serializer raise only rankwise's own errors — never a
bare ValueError/TypeError/MemoryError, never a dead I/O thread. Seeded and bounded (a few
seconds), so it runs in CI; ``RANKWISE_FUZZ_SEED`` replays another seed.
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
from _loopback import connected_pair

import rankwise as dist
from rankwise.core.communicator import Communicator
from rankwise.store.protocol import DEFAULT_LIMITS, read_request, read_response
from rankwise.transport.tcp import TcpTransport
from rankwise.wire.buffers import as_buffer
from rankwise.wire.frames import Kind, Op, encode_header
from rankwise.wire.serialize import dumps, loads

SEED = int(os.environ.get("RANKWISE_FUZZ_SEED", "20261123"))


# --- the object serializer -----------------------------------------------------------------

def _int_blob(text: bytes) -> bytes:
    return b"Si" + struct.pack("<I", len(text)) + text


@pytest.mark.parametrize("text", [b"1" * 4301, b"9" * 10000, b"--5", b"-", b"", b"+5", b" 5",
                                  b"5 ", b"5_0", "\u0663".encode(), b"0x10", b"1e3", b"-0-"])
def test_bad_integers_raise_invalid_argument(text: bytes) -> None:
    with pytest.raises(dist.InvalidArgument, match="rank 3"):
        loads(_int_blob(text), False, "rank 3")


def test_integers_of_any_size_round_trip() -> None:
    for value in (0, -1, 10**4299, -(10**4299), 10**4300, -(10**5000) - 7, 2**70000):
        assert loads(dumps(value)) == value


def test_integer_fuzz_only_invalid_argument() -> None:
    rng = random.Random(SEED)
    alphabet = b"--0123456789_+ \x00e"
    for _ in range(3000):
        text = bytes(rng.choice(alphabet) for _ in range(rng.randrange(8)))
        if rng.random() < 0.05:
            text = b"7" * rng.randrange(4290, 4310)
        try:
            value = loads(_int_blob(text), False, "rank 1")
        except dist.InvalidArgument:
            continue
        assert value == int(text), text


torch = pytest.importorskip("torch")


def _quantized() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


def test_quantized_tensors_are_refused_before_any_io() -> None:
    q = _quantized()
    with pytest.raises(dist.InvalidArgument, match="quantized"):
        dumps(q)
    with pytest.raises(dist.InvalidArgument, match="quantized"):
        dumps({"w": [q]})
    with pytest.raises(dist.InvalidArgument, match="quantized"):
        as_buffer(q, "tensor")


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32", "quint4x2", "float", "Tensor",
                                  "__class__"])
def test_object_decoder_refuses_quantized_and_odd_torch_dtypes(name: str) -> None:
    raw = b"abcd"
    blob = (b"Sx" + struct.pack("<I", len(name)) + name.encode() + struct.pack("<I", 1)
            + struct.pack("<q", 4) + struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(dist.InvalidArgument, match="rank 2"):
        loads(blob, False, "rank 2")


def test_object_decoder_mutation_fuzz() -> None:
    rng = random.Random(SEED + 1)
    samples: list[Any] = [10**5000, -3, [1, 2.5, "x"], {"t": torch.arange(6).reshape(2, 3)},
                          (torch.zeros(2, dtype=torch.bfloat16), np.ones(3, np.int16)),
                          {frozenset({1}): b"\x00"}]
    blobs = [dumps(s) for s in samples]
    deadline = time.monotonic() + 4.0
    tried = 0
    while time.monotonic() < deadline and tried < 20_000:
        blob = bytearray(rng.choice(blobs))
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(3)
            if op == 0 and blob:
                blob[rng.randrange(len(blob))] = rng.getrandbits(8)
            elif op == 1:
                blob = blob[:rng.randrange(len(blob) + 1)]
            else:
                pos = rng.randrange(len(blob) + 1)
                blob[pos:pos] = rng.choice([b"i", b"I", b"x", b"-", b"q", b"\xff\xff\xff\x7f"])
        tried += 1
        try:
            loads(bytes(blob), False, "rank 5")
        except dist.InvalidArgument:
            pass
        except Exception as exc:
            raise AssertionError(f"loads({bytes(blob)[:200]!r}) raised {exc!r}") from exc
    assert tried > 500


# --- the store protocol --------------------------------------------------------------------

def test_store_protocol_decoder_fuzz() -> None:
    from rankwise.store.protocol import Op as StoreOp
    from rankwise.store.protocol import encode_request

    rng = random.Random(SEED + 2)
    from rankwise.store.protocol import Status, encode_int, encode_response

    valid = [encode_request(StoreOp.SET, [b"key", b"value"]),
             encode_request(StoreOp.GET, [b"key", encode_int(1000)]),
             encode_request(StoreOp.WAIT, [encode_int(5), b"a", b"b"]),
             encode_response(Status(next(iter(Status))), [b"v" * 40])]
    deadline = time.monotonic() + 4.0
    tried = 0
    while time.monotonic() < deadline and tried < 3000:
        if rng.random() < 0.5:
            data = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            data = data[:rng.randrange(1, len(data) + 1)]
        else:
            data = bytearray(rng.randbytes(rng.randrange(1, 40)))
        a, b = socket.socketpair()
        try:
            b.sendall(bytes(data))
            b.close()
            a.settimeout(1.0)
            reader = read_request if tried % 2 else read_response
            try:
                reader(a, DEFAULT_LIMITS, "fuzzer")
            except dist.DistError:
                pass
            except Exception as exc:
                raise AssertionError(f"{reader.__name__}({bytes(data)!r}) raised {exc!r}") \
                    from exc
        finally:
            a.close()
        tried += 1
    assert tried > 200


# --- the frame reader of a live transport --------------------------------------------------

def _frames(rng: random.Random) -> bytes:
    out = bytearray()
    for _ in range(rng.randrange(1, 6)):
        kind = rng.choice([Kind.P2P, Kind.OBJ, Kind.COLL, Kind.SITE, Kind.HERE, Kind.BYE])
        n = rng.choice([0, 1, 16, 300, 1 << 16])
        header = bytearray(encode_header(kind, group=0, seq=rng.randrange(3),
                                         op=int(rng.choice(list(Op))), dtype=rng.randrange(20),
                                         count=rng.randrange(-1, 64), tag=rng.randrange(3),
                                         step=rng.randrange(3), payload_len=n))
        if rng.random() < 0.3:  # a hostile field: a huge claim, or a flipped byte
            if rng.random() < 0.5:
                header[-8:] = struct.pack("<Q", rng.choice([1 << 40, (1 << 40) + 1, 1 << 33]))
            else:
                header[rng.randrange(len(header))] = rng.getrandbits(8)
        out += header + rng.randbytes(min(n, 4096))
    return bytes(out)


def test_frame_reader_fuzz_fails_loudly_never_silently() -> None:
    rng = random.Random(SEED + 3)
    escaped: list[BaseException] = []
    old_hook = threading.excepthook

    def hook(args: Any) -> None:
        escaped.append(args.exc_value)

    threading.excepthook = hook
    try:
        deadline = time.monotonic() + 6.0
        runs = 0
        while time.monotonic() < deadline and runs < 40:
            mine, peer = connected_pair()
            comm = Communicator(0, 2, TcpTransport(0, 2, {1: mine}))
            try:
                waiter = comm.router.post_p2p(Kind.P2P, 0, 1, 0, memoryview(bytearray(16)))
                try:
                    peer.sendall(_frames(rng))
                except OSError:
                    pass
                peer.close()  # the end of the stream: the reader must notice it
                try:
                    waiter.wait(time.monotonic() + 5.0, lambda: "the reader went silent")
                except dist.DistTimeout as exc:
                    raise AssertionError("the reader neither delivered nor failed") from exc
                except dist.DistError:
                    pass
            finally:
                comm.closed = True
                comm.transport.close()
            runs += 1
        assert runs >= 5
    finally:
        threading.excepthook = old_hook
    assert not escaped, escaped
