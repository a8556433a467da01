"""The TCP store's frame codec on its own: round trips and hostile inputs."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from rankwise.errors import DistNetworkError, InvalidArgument
from rankwise.store.protocol import (
    DEFAULT_LIMITS,
    Limits,
    Op,
    ProtocolError,
    Status,
    decode_int,
    encode_int,
    encode_request,
    encode_response,
    read_request,
    read_response,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pipe() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _send_in_thread(sock: socket.socket, data: bytes) -> threading.Thread:
    """Write ``data`` from a thread so frames larger than the socket buffer can flow."""
    t = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    t.start()
    return t


def test_request_round_trip_including_large_chunked_value(
    pipe: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pipe
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: read in several chunks
    sender = _send_in_thread(a, encode_request(Op.SET, [b"key", big]))
    req = read_request(b, DEFAULT_LIMITS, "peer", frame_timeout=5)
    sender.join(5)
    assert req.op is Op.SET and req.fields == (b"key", big)
    a.sendall(encode_request(Op.WAIT, [encode_int(1500), b"k1", b"k2"]))
    req = read_request(b, DEFAULT_LIMITS, "peer")
    assert req.op is Op.WAIT and decode_int(req.fields[0]) == 1500
    assert req.fields[1:] == (b"k1", b"k2")
    assert b.gettimeout() == 5  # frame timeout restored


def test_response_round_trip(pipe: tuple[socket.socket, socket.socket]) -> None:
    a, b = pipe
    a.sendall(encode_response(Status.TIMEOUT, [b"missing"]))
    resp = read_response(b, DEFAULT_LIMITS, "peer")
    assert resp.status is Status.TIMEOUT and resp.fields == (b"missing",)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (struct.pack("!BH", 0, 0), "unknown opcode"),
        (struct.pack("!BH", Op.NUM_KEYS, 1), "takes 0 fields"),
        (struct.pack("!BH", Op.CHECK, 5000), "more than the limit"),
        (struct.pack("!BHI", Op.DELETE, 1, 4097), "exceeds the limit"),
        (struct.pack("!BHI", Op.ADD, 2, 1) + b"k" + struct.pack("!I", 4) + b"abcd", "integer"),
    ],
)
def test_hostile_requests_are_refused_before_reading_payload(
    pipe: tuple[socket.socket, socket.socket], frame: bytes, match: str
) -> None:
    a, b = pipe
    a.sendall(frame)
    with pytest.raises(ProtocolError, match=match):
        read_request(b, DEFAULT_LIMITS, "peer")


def test_truncated_frame_is_a_network_error(pipe: tuple[socket.socket, socket.socket]) -> None:
    a, b = pipe
    a.sendall(encode_request(Op.SET, [b"k", b"value"])[:-2])
    a.close()
    with pytest.raises(DistNetworkError, match="closed"):
        read_request(b, DEFAULT_LIMITS, "peer")


def test_encoder_enforces_limits_and_schema() -> None:
    small = Limits(max_key_bytes=4, max_value_bytes=8, max_keys=2)
    with pytest.raises(InvalidArgument, match="key of 5 bytes"):
        encode_request(Op.DELETE, [b"12345"], small)
    with pytest.raises(InvalidArgument, match="value of 9 bytes"):
        encode_request(Op.SET, [b"k", b"123456789"], small)
    with pytest.raises(InvalidArgument, match="3 keys"):
        encode_request(Op.CHECK, [b"a", b"b", b"c"], small)
    with pytest.raises(InvalidArgument, match="takes 2 fields"):
        encode_request(Op.SET, [b"k"], small)
    with pytest.raises(InvalidArgument):
        encode_int(2**63)
    with pytest.raises(InvalidArgument):
        Limits(max_keys=0)
