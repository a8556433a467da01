"""A safe serializer for the objects that object collectives carry.

Why not pickle: unpickling bytes from the network runs whatever code the sender chose.
Object collectives in rankwise therefore carry plain data only — None, bool, int, float,
complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, numpy arrays and torch
tensors — in a small tagged binary format whose decoder bounds every length and depth.
Anything else raises ``InvalidArgument`` that explains the opt-in: ``allow_pickle=True``
(or ``RANKWISE_ALLOW_PICKLE=1``) on both sides, for jobs whose every rank is trusted.
"""

from __future__ import annotations

import pickle
import re
import struct
import sys
from typing import Any

import numpy as np

from .. import settings
from ..errors import InvalidArgument
from .host_view import host_view

__all__ = ["dumps", "loads", "pickle_allowed"]

_MAX_DEPTH = 200
_PICKLE_ENV = "RANKWISE_ALLOW_PICKLE"
_U32 = struct.Struct("<I")
_BYTE = np.dtype(np.uint8)
_F64 = struct.Struct("<d")
#: decimal ints ("i"): what ``int()`` takes without the str-conversion digit limit
_DECIMAL = re.compile(rb"-?[0-9]{1,4300}")
#: torch dtypes an object message may carry: those rankwise sends (no quantized types)
_TORCH_OK = frozenset((
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))


def pickle_allowed(flag: bool | None) -> bool:
    if flag is not None:
        return bool(flag)
    return settings.flag(_PICKLE_ENV)


def _opt_in_help(what: str) -> str:
    return (
        f"{what}. rankwise object collectives carry plain data only (None, bool, int, float, "
        "complex, str, bytes, list, tuple, dict, set, numpy arrays, torch tensors) because "
        "unpickling bytes from another process runs any code that process chose. If every "
        "rank of this job is trusted, pass allow_pickle=True (or set RANKWISE_ALLOW_PICKLE=1) "
        "on all ranks"
    )


def dumps(obj: Any, allow_pickle: bool = False) -> bytes:
    out = bytearray()
    try:
        _enc(obj, out, 0)
    except _Unsupported as exc:
        if not allow_pickle:
            raise InvalidArgument(_opt_in_help(f"cannot send an object of type {exc.args[0]}"))\
                from None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return b"P" + data
    return b"S" + bytes(out)


def loads(data: bytes | bytearray | memoryview, allow_pickle: bool = False,
          sender: str = "a peer") -> Any:
    raw = bytes(data)
    if not raw:
        raise InvalidArgument(f"{sender} sent an empty object message")
    if raw[:1] == b"P":
        if not allow_pickle:
            raise InvalidArgument(_opt_in_help(
                f"{sender} sent a pickled object and this rank refuses to unpickle it"))
        return pickle.loads(raw[1:])
    if raw[:1] != b"S":
        raise InvalidArgument(f"{sender} sent an object message in an unknown format")
    dec = _Decoder(memoryview(raw)[1:], sender)
    value = dec.value(0)
    if dec.pos != len(dec.buf):
        raise InvalidArgument(f"{sender} sent trailing bytes after an object")
    return value


_CONTAINER_TAGS: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"e", frozenset: b"z"}


class _Unsupported(Exception):
    pass


def _put_bytes(out: bytearray, tag: bytes, data: bytes) -> None:
    out += tag
    out += _U32.pack(len(data))
    out += data


def _enc(obj: Any, out: bytearray, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise InvalidArgument(f"object nesting deeper than {_MAX_DEPTH}")
    t = type(obj)
    if obj is None:
        out += b"N"
    elif t is bool:
        out += b"T" if obj else b"F"
    elif t is int:
        if -_DECIMAL_MAX < obj < _DECIMAL_MAX:
            _put_bytes(out, b"i", str(obj).encode())
        else:  # past int()'s digit limit: two's-complement bytes
            _put_bytes(out, b"I", obj.to_bytes(obj.bit_length() // 8 + 1, "little",
                                               signed=True))
    elif t is float:
        out += b"f" + _F64.pack(obj)
    elif t is complex:
        out += b"c" + _F64.pack(obj.real) + _F64.pack(obj.imag)
    elif t is str:
        _put_bytes(out, b"s", obj.encode("utf-8", "surrogatepass"))
    elif t is bytes:
        _put_bytes(out, b"b", obj)
    elif t is bytearray:
        _put_bytes(out, b"B", bytes(obj))
    elif t in (list, tuple, set, frozenset):
        tag = _CONTAINER_TAGS[t]
        out += tag + _U32.pack(len(obj))
        for item in obj:
            _enc(item, out, depth + 1)
    elif t is dict:
        out += b"d" + _U32.pack(len(obj))
        for k, v in obj.items():
            _enc(k, out, depth + 1)
            _enc(v, out, depth + 1)
    elif isinstance(obj, np.ndarray):
        _enc_array(out, b"a", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    elif _is_torch_tensor(obj):
        if obj.is_quantized:
            raise InvalidArgument(
                f"cannot send a quantized tensor ({obj.dtype}) in an object message: its "
                "scale and zero point would be lost; send tensor.dequantize(), or "
                "tensor.int_repr() with q_scale()/q_zero_point()")
        t_cpu = obj.detach().cpu().contiguous()
        name = str(t_cpu.dtype).removeprefix("torch.")
        # host_view, not numpy(): the latter would leave the user's storage unresizable
        raw = host_view(t_cpu.reshape(-1).view(__import__("torch").uint8), _BYTE,
                        t_cpu).tobytes()
        _enc_array(out, b"x", name, tuple(t_cpu.shape), raw)
    elif isinstance(obj, (np.generic,)):
        _enc(obj.item(), out, depth)
    else:
        raise _Unsupported(t.__qualname__)


def _enc_array(out: bytearray, tag: bytes, dtype: str, shape: tuple[int, ...],
               raw: bytes) -> None:
    out += tag
    _put_bytes(out, b"", dtype.encode())
    out += _U32.pack(len(shape))
    for d in shape:
        out += struct.pack("<q", d)
    out += struct.pack("<Q", len(raw))
    out += raw


_DECIMAL_MAX = 10 ** 4000


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


_NUMPY_OK = {np.dtype(n).str for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}


class _Decoder:
    def __init__(self, buf: memoryview, sender: str) -> None:
        self.buf = buf
        self.pos = 0
        self.sender = sender

    def _bad(self, why: str) -> InvalidArgument:
        return InvalidArgument(f"malformed object message from {self.sender}: {why}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self._bad("truncated")
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def blob(self) -> bytes:
        return self.take(self.u32())

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise self._bad("nested too deep")
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            text = self.blob()
            if not _DECIMAL.fullmatch(text):
                raise self._bad("bad integer")
            return int(text)
        if tag == b"I":
            return int.from_bytes(self.blob(), "little", signed=True)
        if tag == b"f":
            return float(_F64.unpack(self.take(8))[0])
        if tag == b"c":
            re, im = struct.unpack("<dd", self.take(16))
            return complex(re, im)
        if tag == b"s":
            try:
                return self.blob().decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise self._bad("string is not valid UTF-8") from None
        if tag == b"b":
            return self.blob()
        if tag == b"B":
            return bytearray(self.blob())
        if tag in (b"l", b"t", b"e", b"z"):
            n = self.u32()
            if n > len(self.buf) - self.pos:
                raise self._bad("container longer than the message")
            items = [self.value(depth + 1) for _ in range(n)]
            if tag == b"l":
                return items
            if tag == b"t":
                return tuple(items)
            try:
                return set(items) if tag == b"e" else frozenset(items)
            except TypeError:
                raise self._bad("unhashable set member") from None
        if tag == b"d":
            n = self.u32()
            if n > len(self.buf) - self.pos:
                raise self._bad("dict longer than the message")
            out = {}
            for _ in range(n):
                k = self.value(depth + 1)
                try:
                    out[k] = self.value(depth + 1)
                except TypeError:
                    raise self._bad("unhashable dict key") from None
            return out
        if tag in (b"a", b"x"):
            return self._array(tag)
        raise self._bad(f"unknown tag {tag!r}")

    def _array(self, tag: bytes) -> Any:
        dtype = self.blob().decode("ascii", "replace")
        ndim = self.u32()
        if ndim > 64:
            raise self._bad("too many dimensions")
        shape = tuple(struct.unpack("<q", self.take(8))[0] for _ in range(ndim))
        if any(d < 0 for d in shape):
            raise self._bad("negative dimension")
        raw = self.take(struct.unpack("<Q", self.take(8))[0])
        numel = 1
        for d in shape:  # python ints: no overflow on hostile shapes
            numel *= d
        if tag == b"a":
            if dtype not in _NUMPY_OK:
                raise self._bad(f"numpy dtype {dtype!r} not allowed")
            if numel * np.dtype(dtype).itemsize != len(raw):
                raise self._bad("array size does not match its shape")
            return np.frombuffer(raw, dtype=np.dtype(dtype)).copy().reshape(shape)
        try:
            import torch  # the sender sent a tensor, so it expects torch here too
        except ImportError:
            raise self._bad("it contains a torch tensor but torch is not installed here") \
                from None
        tdtype = getattr(torch, dtype, None) if dtype in _TORCH_OK else None
        if not isinstance(tdtype, torch.dtype):
            raise self._bad(f"torch dtype {dtype!r} not allowed (quantized and unknown "
                            "dtypes are refused)")
        if numel * tdtype.itemsize != len(raw):
            raise self._bad("tensor size does not match its shape")
        if not raw:
            return torch.empty(shape, dtype=tdtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdtype).reshape(shape)
