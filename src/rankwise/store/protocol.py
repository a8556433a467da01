"""Wire format of the TCP store: length-prefixed binary frames, shared by server and client.

Why one module: the encoder the client uses and the decoder the server uses must agree
byte for byte, and the limits that protect the server must be the same numbers the
client checks before it sends anything. Keeping both halves here means there is one
definition of the format and no way for them to drift apart.

Frame layout (network byte order, no pickle, nothing is ever evaluated)::

    header   code:u8  nfields:u16        code = Op for requests, Status for replies
    field    length:u32  bytes[length]   repeated nfields times

Each opcode has a schema: a fixed list of field kinds plus optionally a repeated tail
kind (``WAIT``/``CHECK`` take any number of keys up to ``Limits.max_keys``). Every kind
has its own length bound, checked *before* the bytes are read, so a hostile peer can
never make the reader allocate more than the bound, and a field is received in chunks
so memory only grows as data actually arrives. Integers travel as 8-byte signed fields.

Replies carry a status: ``OK`` with the op's result fields, ``TIMEOUT`` with the keys
still missing, ``ERROR`` with a message (e.g. ``add`` on a non-integer value), or
``CLOSED`` when the server is shutting down and woke a blocked waiter.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument, StoreError
from ..wire.auth import recv_exact

__all__ = [
    "DEFAULT_LIMITS",
    "Kind",
    "Limits",
    "Op",
    "ProtocolError",
    "Request",
    "Response",
    "Status",
    "decode_int",
    "encode_int",
    "encode_request",
    "encode_response",
    "parse_request",
    "read_request",
    "read_response",
]

_HEADER = struct.Struct("!BH")
_LEN = struct.Struct("!I")
_INT = struct.Struct("!q")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_CHUNK = 1 << 20  # receive large fields in 1 MiB steps
_MAX_MESSAGE = 64 * 1024  # ERROR / CLOSED reply text


class ProtocolError(StoreError):
    """The peer sent bytes that are not a valid frame; the connection must be dropped."""


class Op(enum.IntEnum):
    """Request opcodes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8


class Status(enum.IntEnum):
    """Reply status codes."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2
    CLOSED = 3


class Kind(enum.Enum):
    """What a field holds; decides its length bound."""

    KEY = "key"
    VALUE = "value"
    INT = "int"
    TEXT = "text"


@dataclass(frozen=True)
class Limits:
    """Size bounds of one request, enforced by the server and checked by the client.

    ``max_keys`` caps how many keys one ``wait``/``check`` may name, so that a single
    request cannot make the server hold an unbounded key list.
    """

    max_key_bytes: int = 4 * 1024
    max_value_bytes: int = 64 * 1024 * 1024
    max_keys: int = 4096
    #: the server's bound on all keys and values held together (four largest values)
    max_total_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_keys", "max_total_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"Limits.{name} must be a positive int, got {value!r}")
        if self.max_keys > 0xFFFF - 1:
            raise InvalidArgument(f"Limits.max_keys must be below 65535, got {self.max_keys}")

    def bound(self, kind: Kind) -> int:
        """The largest length a field of ``kind`` may have."""
        if kind is Kind.KEY:
            return self.max_key_bytes
        if kind is Kind.VALUE:
            return self.max_value_bytes
        if kind is Kind.INT:
            return _INT.size
        return _MAX_MESSAGE


DEFAULT_LIMITS = Limits()

# op -> (fixed field kinds, repeated tail kind or None)
_SCHEMAS: dict[Op, tuple[tuple[Kind, ...], Kind | None]] = {
    Op.SET: ((Kind.KEY, Kind.VALUE), None),
    Op.GET: ((Kind.KEY, Kind.INT), None),  # key, timeout in ms
    Op.ADD: ((Kind.KEY, Kind.INT), None),
    Op.COMPARE_SET: ((Kind.KEY, Kind.VALUE, Kind.VALUE), None),
    Op.WAIT: ((Kind.INT,), Kind.KEY),  # timeout in ms, keys...
    Op.CHECK: ((), Kind.KEY),
    Op.DELETE: ((Kind.KEY,), None),
    Op.NUM_KEYS: ((), None),
}


@dataclass(frozen=True)
class Request:
    """A decoded request: its opcode and raw fields (ints still encoded)."""

    op: Op
    fields: tuple[bytes, ...]


@dataclass(frozen=True)
class Response:
    """A decoded reply: its status and raw fields."""

    status: Status
    fields: tuple[bytes, ...]


def encode_int(value: int) -> bytes:
    """8-byte signed big-endian; ``InvalidArgument`` outside int64."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise InvalidArgument(f"integer {value} does not fit in 64 bits")
    return _INT.pack(value)


def decode_int(field: bytes) -> int:
    """Inverse of :func:`encode_int`; ``ProtocolError`` on a wrong length."""
    if len(field) != _INT.size:
        raise ProtocolError(f"integer field has {len(field)} bytes, expected {_INT.size}")
    value: int = _INT.unpack(field)[0]
    return value


def _kinds_for(op: Op, nfields: int, limits: Limits) -> list[Kind]:
    """Field kinds of an ``op`` frame with ``nfields`` fields, or ``ProtocolError``."""
    fixed, tail = _SCHEMAS[op]
    extra = nfields - len(fixed)
    if extra < 0 or (tail is None and extra != 0):
        raise ProtocolError(f"{op.name} takes {len(fixed)} fields, got {nfields}")
    if extra > limits.max_keys:
        raise ProtocolError(f"{op.name} names {extra} keys, more than the limit {limits.max_keys}")
    return list(fixed) + ([tail] * extra if tail is not None else [])


def _frame(code: int, fields: Sequence[bytes]) -> bytes:
    parts = [_HEADER.pack(code, len(fields))]
    for field in fields:
        parts.append(_LEN.pack(len(field)))
        parts.append(field)
    return b"".join(parts)


def encode_request(op: Op, fields: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode a request, refusing (``InvalidArgument``) what the server would reject."""
    try:
        kinds = _kinds_for(op, len(fields), limits)
    except ProtocolError as exc:
        raise InvalidArgument(str(exc)) from None
    for kind, field in zip(kinds, fields):
        bound = limits.bound(kind)
        if len(field) > bound:
            raise InvalidArgument(
                f"{op.name}: {kind.value} of {len(field)} bytes exceeds the store limit of "
                f"{bound} bytes"
            )
    return _frame(op, fields)


def encode_response(status: Status, fields: Sequence[bytes] = ()) -> bytes:
    """Encode a reply (the server builds these only from bounded data)."""
    return _frame(status, fields)


def _read_field(sock: socket.socket, bound: int, what: str) -> bytes:
    """Read one length-prefixed field, refusing lengths over ``bound`` before reading."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, what))
    if length > bound:
        raise ProtocolError(f"{what}: field of {length} bytes exceeds the limit of {bound}")
    if length <= _CHUNK:
        return recv_exact(sock, length, what) if length else b""
    chunks = []
    left = length
    while left:
        step = min(left, _CHUNK)
        chunks.append(recv_exact(sock, step, what))
        left -= step
    return b"".join(chunks)


def read_request(
    sock: socket.socket,
    limits: Limits,
    peer: str,
    frame_timeout: float | None = None,
) -> Request:
    """Read one request from ``sock``; every byte is treated as hostile.

    The header is awaited with the socket's current timeout (an idle client may stay
    quiet for a long time); once it arrived, the rest of the frame must follow within
    ``frame_timeout`` seconds so a client cannot park a half-sent frame forever.
    Raises ``ProtocolError`` for invalid frames and ``DistNetworkError`` when the
    connection ends or stalls.
    """
    code, nfields = _HEADER.unpack(recv_exact(sock, _HEADER.size, f"request from {peer}"))
    try:
        op = Op(code)
    except ValueError:
        raise ProtocolError(f"{peer} sent unknown opcode {code}") from None
    kinds = _kinds_for(op, nfields, limits)
    previous = sock.gettimeout()
    if frame_timeout is not None:
        sock.settimeout(frame_timeout)
    try:
        fields = tuple(
            _read_field(sock, limits.bound(kind), f"{op.name} {kind.value} from {peer}")
            for kind in kinds
        )
    finally:
        if frame_timeout is not None:
            sock.settimeout(previous)
    for kind, field in zip(kinds, fields):
        if kind is Kind.INT:
            decode_int(field)  # length already checked by the bound; keep the check honest
    return Request(op, fields)


def parse_request(buf: bytearray, limits: Limits, peer: str) -> tuple[Request, int] | None:
    """The first whole request in ``buf`` and its length, or ``None`` while it is still
    incomplete: the event-loop server's decoder, with ``read_request``'s checks. Every
    bound is checked as soon as its length prefix is in ``buf``, so a hostile peer can
    make the buffer hold at most one bounded field in flight."""
    if len(buf) < _HEADER.size:
        return None
    code, nfields = _HEADER.unpack_from(buf, 0)
    try:
        op = Op(code)
    except ValueError:
        raise ProtocolError(f"{peer} sent unknown opcode {code}") from None
    kinds = _kinds_for(op, nfields, limits)
    pos = _HEADER.size
    spans = []
    for kind in kinds:
        if len(buf) < pos + _LEN.size:
            return None
        (length,) = _LEN.unpack_from(buf, pos)
        bound = limits.bound(kind)
        if length > bound:
            raise ProtocolError(f"{op.name} {kind.value} from {peer}: field of {length} bytes "
                                f"exceeds the limit of {bound}")
        if kind is Kind.INT and length != _INT.size:
            raise ProtocolError(f"integer field has {length} bytes, expected {_INT.size}")
        pos += _LEN.size
        spans.append((pos, pos + length))
        pos += length
    if len(buf) < pos:
        return None
    return Request(op, tuple(bytes(buf[a:b]) for a, b in spans)), pos


def read_response(sock: socket.socket, limits: Limits, peer: str) -> Response:
    """Read one reply; bounded like requests so a broken server cannot exhaust memory."""
    code, nfields = _HEADER.unpack(recv_exact(sock, _HEADER.size, f"reply from {peer}"))
    try:
        status = Status(code)
    except ValueError:
        raise ProtocolError(f"{peer} sent unknown reply status {code}") from None
    if nfields > limits.max_keys:
        raise ProtocolError(f"{peer} sent a reply with {nfields} fields")
    bound = max(limits.max_value_bytes, _MAX_MESSAGE)
    fields = tuple(_read_field(sock, bound, f"reply from {peer}") for _ in range(nfields))
    return Response(status, fields)
