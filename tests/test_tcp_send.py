"""The transport's send path: whole frames in one call when the socket has room, the
rest in pieces when it has not — the bytes on the wire are the same either way."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from rankwise.transport.tcp import TcpTransport
from rankwise.wire.frames import HEADER, Kind, decode_header, encode_header


def _read_all(sock: socket.socket, n: int, out: list[bytes], gate: threading.Event) -> None:
    gate.wait(10)  # start reading only once the sender had to wait for room
    chunks, got = [], 0
    sock.settimeout(10)
    while got < n:
        data = sock.recv(1 << 20)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    out.append(b"".join(chunks))


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return a, b


def test_frames_survive_partial_sends_and_empty_payloads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_SOCKBUF", str(1 << 16))  # small: the big frame must wait
    a, b = _tcp_pair()
    transport = TcpTransport(0, 2, {1: a})
    payload = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    frames = [
        (encode_header(Kind.COLL, group=1, seq=1, step=0, payload_len=0), b""),
        (encode_header(Kind.COLL, group=1, seq=1, step=1, payload_len=payload.nbytes),
         payload.tobytes()),
        (encode_header(Kind.COLL, group=1, seq=1, step=2, payload_len=0), b""),
    ]
    total = sum(len(h) + len(p) for h, p in frames)
    out: list[bytes] = []
    gate = threading.Event()
    reader = threading.Thread(target=_read_all, args=(b, total, out, gate), daemon=True)
    reader.start()
    try:
        transport.send(1, frames[0][0], None, time.monotonic() + 10)
        timer = threading.Timer(0.2, gate.set)  # the 8 MiB send must wait for room
        timer.start()
        transport.send(1, frames[1][0], payload.data, time.monotonic() + 10)
        transport.send(1, frames[2][0], memoryview(b""), time.monotonic() + 10)
        reader.join(15)
        timer.cancel()
    finally:
        gate.set()
        transport.close()
        b.close()
    assert out and len(out[0]) == total
    wire = out[0]
    pos = 0
    for header, body in frames:
        frame = decode_header(wire, pos)
        assert wire[pos:pos + HEADER.size] == header
        pos += HEADER.size
        assert wire[pos:pos + frame.payload_len] == body
        pos += frame.payload_len
    assert pos == total
