"""Backend strings: ``"gloo"``, ``"nccl"``, torch's ``"cpu:gloo,cuda:nccl"``.

Why parsed here, once: the API validates the string before any I/O, and the engine
choice needs its two halves: which engine moves host memory (rankwise's own unless the
CPU half names ``torch-gloo``) and whether CUDA tensors get NCCL (else they are staged
through host memory onto the CPU engine, as torch's gloo does).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["CPU_BACKENDS", "BackendSpec", "parse_backend"]

#: what may move CPU tensors (every one but torch-gloo is rankwise's own engine)
CPU_BACKENDS = frozenset(("tcp", "gloo", "torch-gloo"))
#: what may move CUDA tensors: NCCL, or a CPU backend (staged through host memory)
CUDA_BACKENDS = frozenset(("nccl", *CPU_BACKENDS))


@dataclass(frozen=True)
class BackendSpec:
    """A parsed backend string: ``name`` as ``get_backend`` reports it, the CPU half
    (``"tcp"``, ``"gloo"``, ``"torch-gloo"``) and whether CUDA tensors use NCCL."""

    name: str
    cpu: str
    nccl: bool


def parse_backend(backend: str) -> BackendSpec:
    """Parse a lower-cased backend string; ``InvalidArgument`` names what is wrong."""
    cpu: str | None = None
    cuda: str | None = None
    for part in backend.split(","):
        device, sep, name = part.strip().rpartition(":")
        if not sep:  # a bare name serves the devices it can
            if name == "nccl":
                cuda = _once(cuda, name, "cuda", backend)
            elif name in CPU_BACKENDS:
                cpu = _once(cpu, name, "cpu", backend)
            else:
                raise _unknown(backend, name)
        elif device == "cpu":
            if name == "nccl":
                raise InvalidArgument(f"backend {backend!r}: NCCL moves CUDA tensors only; "
                                      "use 'cpu:gloo,cuda:nccl'")
            if name not in CPU_BACKENDS:
                raise _unknown(backend, name)
            cpu = _once(cpu, name, "cpu", backend)
        elif device == "cuda":
            if name not in CUDA_BACKENDS:
                raise _unknown(backend, name)
            cuda = _once(cuda, name, "cuda", backend)
        else:
            raise InvalidArgument(f"backend {backend!r}: unknown device {device!r}; rankwise "
                                  "maps 'cpu' and 'cuda' (e.g. 'cpu:gloo,cuda:nccl')")
    if cpu is None and cuda is None:
        raise _unknown(backend, backend)
    name = "torch-gloo" if backend == "cpu:torch-gloo" else backend
    return BackendSpec(name, cpu or "gloo", cuda == "nccl")


def _once(seen: str | None, name: str, device: str, backend: str) -> str:
    if seen is not None:
        raise InvalidArgument(f"backend {backend!r} names two backends for {device} "
                              f"tensors ({seen!r} and {name!r})")
    return name


def _unknown(backend: str, name: str) -> InvalidArgument:
    return InvalidArgument(f"unknown backend {name!r} in {backend!r}; rankwise offers 'tcp' "
                           "(alias 'gloo'), 'torch-gloo' and, for CUDA tensors, 'nccl' "
                           "(e.g. 'cpu:gloo,cuda:nccl')")
