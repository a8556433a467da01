"""The frame format every rankwise message uses between ranks.

A frame is a fixed 56-byte header followed by ``payload_len`` bytes. The header carries
the fingerprint of the call that sent it (group, sequence number, op, dtype, element
count, root, reduce op, call-site id), so the receiver can compare it with its own call
before it touches the payload: a mismatch costs no extra round trip and is caught on
the first frame that crosses it.

The decoder treats every byte as hostile: magic and version are checked, the payload
length is bounded, kinds and codes outside the known ranges are rejected.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

__all__ = [
    "CALL_FLAGS",
    "CHECK_ENTRY",
    "CHECK_KEY",
    "DROP",
    "HEADER",
    "HOLD",
    "LANE_FLAGS",
    "MAX_CONTROL_PAYLOAD",
    "MAX_PAYLOAD",
    "Flag",
    "Frame",
    "Kind",
    "Op",
    "WireError",
    "decode_checks",
    "decode_header",
]

MAGIC = 0x5257  # "RW"
VERSION = 1
#: magic u16, version u8, kind u8, group u32, seq u64, op u8, dtype u8, reduce u8, flags u8,
#: root i32, count i64, tag i64, site u32, step u32, payload_len u64
HEADER = struct.Struct("<HBBIQBBBBiqqIIQ")
assert HEADER.size == 56
#: No single frame may claim more than this; larger messages are a corrupt or hostile peer.
MAX_PAYLOAD = 1 << 40
#: Control frames (errors, reports, call-site names) are small by construction.
MAX_CONTROL_PAYLOAD = 16 << 20


#: ``FrameHandler.on_header`` answers with ``(None, DROP)``: read the payload and drop it
#: (a frame that contradicts our call: never allocate what it claims)
DROP = "drop"
#: ... or with ``(None, HOLD)``: no room for this frame now; stop reading this peer until
#: ``Transport.resume(rank)`` (its sender then waits, by TCP flow control)
HOLD = "hold"


class WireError(ValueError):
    """Bytes on a connection that are not a valid rankwise frame."""


class Kind(enum.IntEnum):
    """What a frame is for; decides which mailbox it lands in."""

    COLL = 1  #: part of a collective, matched by (group, seq, src)
    P2P = 2  #: user point-to-point, matched by (src, tag) in arrival order
    SITE = 3  #: defines a call-site id -> "file:line in fn" text for this connection
    ABORT = 4  #: the sender failed or found a mismatch; payload is a JSON description
    BYE = 5  #: the sender is leaving cleanly (destroy_process_group / exit)
    WHERE = 6  #: "where are you?" request (payload: request id)
    HERE = 7  #: answer to WHERE (payload: JSON state report)
    OBJ = 8  #: library-internal p2p for object send/recv, never matches user recv
    #: fingerprints of several collective calls at once (payload: ``CHECK_ENTRY`` each),
    #: each judged as the empty collective frame it stands for (``core/ring_check``)
    CHECKS = 9
    BEAT = 10  #: "still here" to the ring successor (payload: hostname; core.heartbeat)
    #: "blocked for a while in the call that began at ``tag`` µs" to the job's deadlock
    #: prober (header only; checks.prober)
    BLOCKED = 11


class Op(enum.IntEnum):
    """Operation codes carried in headers; names are what error messages show."""

    NONE = 0
    broadcast = 1
    scatter = 2
    reduce = 3
    all_reduce = 4
    gather = 5
    all_gather = 6
    all_gather_into_tensor = 7
    reduce_scatter = 8
    reduce_scatter_tensor = 9
    all_to_all = 10
    all_to_all_single = 11
    barrier = 12
    send = 13
    recv = 14
    broadcast_object_list = 15
    all_gather_object = 16
    gather_object = 17
    scatter_object_list = 18
    monitored_barrier = 19
    object_sizes = 20


class Flag(enum.IntFlag):
    """Bits of the header's ``flags`` byte: markers that say what kind of frame this is,
    so that no other field has to carry a magic value for them (a root or a step number
    that a real call might one day use).

    Two families, told apart by what the receiver does with them:

    - *call* flags (``CALL_FLAGS``) are part of the call's identity and compared like its
      op and root: ``SYNC`` marks the barrier of a ``rank_zero_first`` block, so a plain
      barrier that meets it is a mismatch, named as the rank-0-first trap; ``DEVICE``
      marks a call on CUDA tensors of a group with two data planes (NCCL beside a CPU
      engine), so a rank that passed a CPU tensor to the same call, whose data went to
      the other plane where nothing can meet it, is a mismatch, not a hang;
    - *lane* flags (``LANE_FLAGS``) tell apart messages of one call that are not numbered
      data steps; they are part of the matching key, not of the identity: ``CTS`` is the
      ring's clear-to-send, ``GATHER`` the reduced chunks sent to a reduce's root,
      ``CHECK`` a fingerprint-only frame of a foreign engine's ring check.
    """

    SYNC = 0x01
    DEVICE = 0x02
    CTS = 0x10
    GATHER = 0x20
    CHECK = 0x40


#: flags compared as part of the call (``Fingerprint.flags``)
CALL_FLAGS = int(Flag.SYNC | Flag.DEVICE)
#: flags that select a message lane within one call (part of the router's key)
LANE_FLAGS = int(Flag.CTS | Flag.GATHER | Flag.CHECK)
#: any other bit is a corrupt or newer peer
_UNKNOWN_FLAGS = 0xFF & ~(CALL_FLAGS | LANE_FLAGS)

_KINDS = frozenset(int(k) for k in Kind)
_OPS = frozenset(int(o) for o in Op)


class Frame(NamedTuple):
    """A decoded header (the payload is read separately, into its destination).

    A tuple, not a dataclass: the receiver builds one per frame, and ``tuple.__new__``
    does that in C where a generated ``__init__`` ran ~30 interpreter steps.
    """

    kind: int
    group: int
    seq: int
    op: int
    dtype: int
    reduce: int
    flags: int
    root: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, on purpose
    tag: int
    site: int
    step: int
    payload_len: int
    src: int = -1  #: the receiver's side: the global rank of the connection it came on

    def encode(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, *self[:13])


def encode_header(
    kind: int,
    group: int = 0,
    seq: int = 0,
    op: int = 0,
    dtype: int = 0,
    reduce: int = 0,
    flags: int = 0,
    root: int = 0,
    count: int = 0,
    tag: int = 0,
    site: int = 0,
    step: int = 0,
    payload_len: int = 0,
) -> bytes:
    """Pack a header without building a ``Frame`` (the hot send path)."""
    return HEADER.pack(
        MAGIC, VERSION, kind, group, seq, op, dtype, reduce, flags, root, count, tag, site, step,
        payload_len,
    )


_unpack_from = HEADER.unpack_from
_tuple_new = tuple.__new__
#: kinds whose payload may exceed MAX_CONTROL_PAYLOAD
_DATA_KINDS = frozenset((Kind.COLL, Kind.P2P, Kind.OBJ))


def decode_header(data: bytes | bytearray | memoryview, offset: int = 0,
                  src: int = -1) -> Frame:
    """Decode and validate the header at ``data[offset:]``, received from global rank
    ``src``; raise ``WireError`` on anything unexpected.

    Runs once per frame received: the common case is one ``unpack`` and one combined
    test, and only a header that fails it is examined field by field.
    """
    if len(data) - offset < HEADER.size:
        raise WireError(f"header must be {HEADER.size} bytes, got {len(data) - offset}")
    fields = _unpack_from(data, offset)
    if fields[0] != MAGIC or fields[1] != VERSION or fields[2] not in _DATA_KINDS \
            or fields[5] not in _OPS or fields[14] > MAX_PAYLOAD or fields[10] < -1 \
            or fields[8] & _UNKNOWN_FLAGS:
        _validate(fields)
    return _tuple_new(Frame, fields[2:] + (src,))


#: one fingerprint of a ``Kind.CHECKS`` frame: seq u64, op u8, dtype u8, reduce u8,
#: flags u8, root i32, count i64, site u32
CHECK_ENTRY = struct.Struct("<QBBBBiqI")
#: bytes at the start of an entry that two ranks' equal calls share (all but the site)
CHECK_KEY = CHECK_ENTRY.size - 4


def decode_checks(frame: Frame, payload: bytes) -> list[Frame]:
    """The frames a ``Kind.CHECKS`` frame stands for: empty collective frames of its
    group, step and sender, one per entry. Hostile bytes raise ``WireError``."""
    if len(payload) % CHECK_ENTRY.size:
        raise WireError(f"a checks frame of {len(payload)} bytes is not a whole number of "
                        f"{CHECK_ENTRY.size}-byte entries")
    out = []
    for seq, op, dtype, reduce, flags, root, count, site in CHECK_ENTRY.iter_unpack(payload):
        if op not in _OPS or count < -1 or flags & _UNKNOWN_FLAGS:
            raise WireError(f"bad checks entry for call #{seq}: op {op}, count {count}, "
                            f"flags 0x{flags:02x}")
        out.append(_tuple_new(Frame, (Kind.COLL, frame.group, seq, op, dtype, reduce, flags,
                                      root, count, 0, site, frame.step, 0, frame.src)))
    return out


def _validate(fields: tuple[int, ...]) -> None:
    """The slow path of ``decode_header``: name what is wrong, or accept a control frame."""
    (magic, version, kind, _group, _seq, op, _dtype, _reduce, flags, _root, count, _tag,
     _site, _step, payload_len) = fields
    if magic != MAGIC:
        raise WireError(f"bad magic 0x{magic:04x}: the peer is not speaking rankwise")
    if version != VERSION:
        raise WireError(f"wire version {version} differs from ours ({VERSION}): mixed installs?")
    if kind not in _KINDS:
        raise WireError(f"unknown frame kind {kind}")
    if op not in _OPS:
        raise WireError(f"unknown op code {op}")
    if payload_len > MAX_PAYLOAD:
        raise WireError(f"payload length {payload_len} exceeds the limit {MAX_PAYLOAD}")
    if kind not in _DATA_KINDS and payload_len > MAX_CONTROL_PAYLOAD:
        raise WireError(f"control frame of {payload_len} bytes exceeds {MAX_CONTROL_PAYLOAD}")
    if count < -1:
        raise WireError(f"negative element count {count}")
    if flags & _UNKNOWN_FLAGS:
        raise WireError(f"unknown flag bits 0x{flags & _UNKNOWN_FLAGS:02x}")
