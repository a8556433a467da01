"""Turning user tensors (numpy arrays, torch tensors) into flat byte-exact views.

Why: every algorithm works on one contiguous 1-D numpy view that shares memory with the
user's tensor, so results land in place with no copies, and torch stays optional (it is
imported only when a torch tensor is actually passed). A CUDA tensor has no numpy view:
it stays a flat torch tensor (its ``DType.tensor`` is set) for a device engine, see
``wire.device``. dtypes numpy lacks (bfloat16,
float8, complex32) travel as same-width unsigned integers; reductions on bfloat16 go
through float32 with round-to-nearest-even, as torch's CPU kernels do per element.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument
from . import device, hugepages
from .host_view import host_view
from .quiet import call_quietly
from .reduce_op import ReduceOp, coerce_reduce_op, reduce_op_by_code

__all__ = ["Buffer", "DType", "ReduceOp", "as_buffer", "coerce_reduce_op", "commit",
           "dtype_by_code", "on_host", "premultiply", "reduce_into", "reduce_op_by_code"]


@dataclass(frozen=True, slots=True)
class DType:
    """One element type as it travels: wire code, display name, numpy storage dtype."""

    code: int
    name: str
    storage: np.dtype[Any]
    kind: str  #: "float", "int", "uint", "bool", "complex", "bfloat16", "opaque"
    #: the buffer is a flat torch tensor (CUDA), not a numpy view: its call goes to the
    #: group's device engine (``engines.device``); equal codes, so fingerprints agree
    tensor: bool = False


def _d(code: int, name: str, storage: str, kind: str) -> DType:
    return DType(code, name, np.dtype(storage), kind)


_DTYPES = [
    _d(1, "float32", "float32", "float"),
    _d(2, "float64", "float64", "float"),
    _d(3, "float16", "float16", "float"),
    _d(4, "bfloat16", "uint16", "bfloat16"),
    _d(5, "int8", "int8", "int"),
    _d(6, "int16", "int16", "int"),
    _d(7, "int32", "int32", "int"),
    _d(8, "int64", "int64", "int"),
    _d(9, "uint8", "uint8", "uint"),
    _d(10, "uint16", "uint16", "uint"),
    _d(11, "uint32", "uint32", "uint"),
    _d(12, "uint64", "uint64", "uint"),
    _d(13, "bool", "bool", "bool"),
    _d(14, "complex64", "complex64", "complex"),
    _d(15, "complex128", "complex128", "complex"),
    _d(16, "complex32", "uint32", "opaque"),
    _d(17, "float8_e4m3fn", "uint8", "opaque"),
    _d(18, "float8_e5m2", "uint8", "opaque"),
    _d(19, "float8_e4m3fnuz", "uint8", "opaque"),
    _d(20, "float8_e5m2fnuz", "uint8", "opaque"),
    _d(21, "float8_e8m0fnu", "uint8", "opaque"),
]
_BY_CODE = {d.code: d for d in _DTYPES}
_BY_NAME = {d.name: d for d in _DTYPES}
_NUMPY_NATIVE = {d.storage: d for d in _DTYPES if d.kind not in ("bfloat16", "opaque")}


def dtype_by_code(code: int) -> DType | None:
    return _BY_CODE.get(code)


def dtype_name(code: int) -> str:
    d = _BY_CODE.get(code)
    return d.name if d else f"dtype#{code}"


@dataclass(slots=True)
class Buffer:
    """A user tensor seen as a flat, contiguous numpy array sharing its memory."""

    array: npt.NDArray[Any]  #: 1-D view in the storage dtype (a flat tensor if dtype.tensor)
    dtype: DType
    shape: tuple[int, ...]
    original: Any  #: the user's object, returned by object collectives
    #: for a host copy of a tensor-path buffer (``on_host``): the flat tensor it stands
    #: for, which ``commit`` fills with the result
    staged: Any = None

    @property
    def numel(self) -> int:
        # 1-D: numpy view or flat tensor alike; ``shape[0]``, not ``len``: a tensor's
        # ``__len__`` is Python (~1 us per call), its shape is read in C
        return self.array.shape[0]  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def _torch_module() -> Any:
    return sys.modules.get("torch")


def as_buffer(x: Any, what: str, writable: bool = False) -> Buffer:
    """View ``x`` (numpy array or torch CPU tensor) as a ``Buffer``; raise on misuse.

    ``what`` names the argument in error messages ("tensor", "output_tensor_list[2]").
    """
    if isinstance(x, np.ndarray):
        buf = _from_numpy(x, what, writable)
    else:
        torch = _torch_module()
        if torch is None or not isinstance(x, torch.Tensor):
            raise InvalidArgument(
                f"{what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}"
            )
        buf = _from_torch(torch, x, what, writable)
    if buf.nbytes >= hugepages.MIN_BYTES and not buf.dtype.tensor:
        hugepages.advise(buf.array)  # a reused large buffer moves onto 2 MiB pages
    return buf


def on_host(buf: Buffer, copy: bool = True) -> Buffer:
    """``buf``, or for a tensor-path buffer (CUDA) a host copy that stands for it: what
    moves only host memory (point-to-point) stages tensors through it. ``copy``: its
    contents are sent (else it only receives, see ``commit``)."""
    if not buf.dtype.tensor:
        return buf
    d = _BY_CODE[buf.dtype.code]
    arr = device.to_host(buf.array, d) if copy else device.host_empty(buf.array, d)
    return Buffer(arr, d, buf.shape, buf.original, buf.array)


def commit(buf: Buffer) -> None:
    """A received host copy (``on_host``) into the tensor it stands for."""
    if buf.staged is not None:
        device.to_tensor(buf.array, buf.staged)


def _from_numpy(a: npt.NDArray[Any], what: str, writable: bool) -> Buffer:
    d = _NUMPY_NATIVE.get(a.dtype)
    if d is None:
        raise InvalidArgument(f"{what} has dtype {a.dtype}, which rankwise does not send; "
                              f"supported: {', '.join(sorted(_BY_NAME))}")
    if not a.flags.c_contiguous:
        raise InvalidArgument(f"{what} is not contiguous (strides {a.strides}); pass "
                              f"np.ascontiguousarray(x) and copy the result back")
    if writable and not a.flags.writeable:
        raise InvalidArgument(f"{what} is read-only but this call writes its result into it")
    return Buffer(a.reshape(-1), d, tuple(a.shape), a)


#: torch dtype object -> DType, filled on first sight (hashing the dtype object is
#: cheaper than formatting its name on every call)
_TORCH_DTYPES: dict[Any, DType] = {}


def _torch_dtype(t: Any, what: str) -> DType:
    d = _BY_NAME.get(str(t.dtype).removeprefix("torch."))
    if d is None:
        raise InvalidArgument(f"{what} has dtype {t.dtype}, which rankwise does not send")
    _TORCH_DTYPES[t.dtype] = d
    return d


def _from_torch(torch: Any, t: Any, what: str, writable: bool) -> Buffer:
    # The common case in a few attribute reads: a plain dense contiguous CPU tensor of a
    # dtype seen before; anything else takes the checks, which say what is wrong. The
    # view is ``host_view``, never ``Tensor.numpy()``, which would make the user's
    # storage non-resizable (FSDP1 frees its gathered parameters by resizing them).
    d = _TORCH_DTYPES.get(t.dtype)
    if (d is not None and not t.requires_grad and not device.CPU_TENSORS and t.is_cpu
            and t.layout is torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg()):
        return Buffer(host_view(t, d.storage, t), d, tuple(t.shape), t)
    return _checked_torch(torch, t, what, writable)


def _checked_torch(torch: Any, t: Any, what: str, writable: bool) -> Buffer:
    # Every tensor the fast path above refused: each check is one cheap attribute test.
    if not t.is_cpu and t.device.type != "cuda":
        raise InvalidArgument(f"{what} is on {t.device}; rankwise moves CPU and CUDA tensors "
                              "only: call .cpu() first")
    if t.is_quantized:
        raise InvalidArgument(f"{what} is a quantized tensor ({t.dtype}); rankwise does not "
                              "send quantized tensors (their scale and zero point would be "
                              "lost): pass tensor.dequantize(), or tensor.int_repr() and "
                              "send q_scale()/q_zero_point() alongside")
    if t.layout is not torch.strided:
        raise InvalidArgument(f"{what} has layout {t.layout}; only dense (strided) tensors")
    if not t.is_contiguous():
        raise InvalidArgument(f"{what} is not contiguous (shape {tuple(t.shape)}, strides "
                              f"{t.stride()}); pass tensor.contiguous() and copy the result back")
    if t.is_conj() or t.is_neg():
        raise InvalidArgument(f"{what} has its conjugate (or negative) bit set, a lazy view "
                              "whose memory holds other values: pass tensor.resolve_conj() "
                              "(or tensor.resolve_neg())")
    d = _TORCH_DTYPES.get(t.dtype) or _torch_dtype(t, what)
    if t.requires_grad and writable and t.is_leaf:
        # rankwise's own API only: torch's backend hands its tensors over detached
        # (``rankwise.torch._backend``), since gloo writes such tensors where torch asks
        raise InvalidArgument(f"{what} is a leaf tensor that requires grad; in-place "
                              "communication would break autograd: use tensor.detach() "
                              "or run under torch.no_grad()")
    if not t.is_cpu or device.CPU_TENSORS:
        plain = t.detach() if t.requires_grad else t
        return Buffer(device.flat(plain), device.device_dtype(d), tuple(t.shape), t)
    return Buffer(host_view(t, d.storage, t), d, tuple(t.shape), t)


# --- reductions -----------------------------------------------------------------------

_UFUNCS: dict[str, dict[str, Callable[..., Any]]] = {
    "SUM": {"num": np.add, "bool": np.logical_or},
    "AVG": {"num": np.add},
    "PREMUL_SUM": {"num": np.add},  # the factor is applied before (``premultiply``)
    "PRODUCT": {"num": np.multiply, "bool": np.logical_and},
    "MIN": {"num": np.minimum, "bool": np.logical_and},
    "MAX": {"num": np.maximum, "bool": np.logical_or},
    "BAND": {"int": np.bitwise_and, "bool": np.logical_and},
    "BOR": {"int": np.bitwise_or, "bool": np.logical_or},
    "BXOR": {"int": np.bitwise_xor, "bool": np.logical_xor},
}


def check_reducible(d: DType, op: ReduceOp, what: str) -> None:
    """Raise ``InvalidArgument`` for dtype/op pairs no rank could reduce."""
    if d.kind == "opaque":
        raise InvalidArgument(f"{what}: reductions on {d.name} are not supported; cast to "
                              "float32 (or float16/bfloat16) before reducing")
    if op.name in ("BAND", "BOR", "BXOR") and d.kind not in ("int", "uint", "bool"):
        raise InvalidArgument(f"{what}: ReduceOp.{op.name} needs an integer or bool tensor, "
                              f"got {d.name}")
    if op.name in ("AVG", "PREMUL_SUM") and d.kind not in ("float", "bfloat16", "complex"):
        raise InvalidArgument(f"{what}: ReduceOp.{op.name} needs a floating-point tensor, got "
                              f"{d.name}; use SUM and divide (or multiply) yourself")
    if op.name in ("MIN", "MAX") and d.kind == "complex":
        raise InvalidArgument(f"{what}: ReduceOp.{op.name} is undefined for complex tensors")


def _bf16_to_f32(a: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (a.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f: npt.NDArray[np.float32], out: npt.NDArray[np.uint16]) -> None:
    u = f.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(f)
    rounded[nan] = (u[nan] >> 16) | np.uint32(0x0040)  # keep NaN a (quiet) NaN
    np.copyto(out, rounded.astype(np.uint16))


def reduce_into(dst: npt.NDArray[Any], src: npt.NDArray[Any], d: DType, op: ReduceOp) -> None:
    """``dst = op(dst, src)`` elementwise, in place (AVG accumulates a SUM here)."""
    table = _UFUNCS[op.name]
    if d.kind == "bool":
        table["bool"](dst, src, out=dst)
        return
    if d.kind == "bfloat16":
        acc = _bf16_to_f32(dst)
        table["num"](acc, _bf16_to_f32(src), out=acc)
        _f32_to_bf16(acc, dst)
        return
    fn = table.get("int") if op.name in ("BAND", "BOR", "BXOR") else table["num"]
    assert fn is not None
    if d.kind in ("float", "complex"):
        call_quietly(fn, dst, src, out=dst)  # inf/nan propagate silently, as in torch
    else:
        fn(dst, src, out=dst)


def premultiply(arr: npt.NDArray[Any], d: DType, op: ReduceOp | None) -> None:
    """PREMUL_SUM's first step, on this rank's own contribution: ``arr *= factor``.

    A no-op for every other operator, so each reducing collective calls it unconditionally
    on the buffer it is about to send (the user's tensor where torch overwrites it anyway,
    a private copy otherwise)."""
    if op is None or op.factor is None:
        return
    if d.tensor:
        arr.mul_(op.factor)  # type: ignore[attr-defined]  # a flat torch tensor
        return
    if d.kind == "bfloat16":
        f = _bf16_to_f32(arr)
        f *= np.float32(op.factor)
        _f32_to_bf16(f, arr)
    else:
        np.multiply(arr, op.factor, out=arr, casting="unsafe")


def divide_in_place(arr: npt.NDArray[Any], d: DType, n: int) -> None:
    """Finish an AVG: divide the accumulated sum by the number of ranks."""
    if d.kind == "bfloat16":
        f = _bf16_to_f32(arr)
        f /= np.float32(n)
        _f32_to_bf16(f, arr)
    else:
        np.divide(arr, n, out=arr, casting="unsafe")
