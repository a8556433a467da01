"""Which engine runs a call on tensors that stay tensors (CUDA; see ``wire.device``).

Why a pair: torch's ``"cpu:gloo,cuda:nccl"`` gives a group two data planes chosen per
tensor. A group whose backend names NCCL gets a ``DevicePair``: its CPU engine (tcp, shm
or torch-gloo, chosen as for any group) for numpy arrays and CPU tensors, and the NCCL
engine for CUDA tensors. Plain ``"nccl"`` is served the same way, more permissively than
torch: CPU tensors and object collectives keep working on the CPU engine. Every other
group stages CUDA tensors through host memory onto its CPU engine (``Staged``), built
per call (it holds nothing but the engine it wraps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...wire.frames import Flag
from ..base import Array, Call, Engine
from .staged import Staged

if TYPE_CHECKING:
    from ...core.group import ProcessGroup

__all__ = ["DevicePair", "device_engine"]

_DEVICE = int(Flag.DEVICE)


def device_engine(group: ProcessGroup) -> tuple[Engine, int]:
    """The engine for ``group``'s calls on flat torch tensors, and the call flags it
    adds: ``Flag.DEVICE`` where that engine is another data plane than the host
    memory's (a ``DevicePair``'s), so that a rank that passed host memory to the same
    call is a mismatch rather than a wait on a plane where nothing comes. Staged calls
    share the host plane: host memory on another rank meets them there as usual."""
    engine = group.engine
    if isinstance(engine, DevicePair):
        return engine.device, _DEVICE
    return Staged(engine), 0


class DevicePair:
    """A group's two data planes: ``host`` for host memory, ``device`` for tensors. The
    API sends tensor calls to ``device`` itself (``device_engine``); every method here
    is the host plane's."""

    def __init__(self, host: Engine, device: Engine) -> None:
        self.host = host
        self.device = device
        #: the host plane's (every method here is its): a host engine streams nothing
        self.caps = host.caps
        self.name = f"{host.name}+{device.name}"
        self.serial = host.serial
        self.framed = host.framed

    def broadcast(self, call: Call, data: Array, root: int) -> None:
        self.host.broadcast(call, data, root)

    def all_reduce(self, call: Call, data: Array) -> None:
        self.host.all_reduce(call, data)

    def reduce(self, call: Call, data: Array, root: int) -> None:
        self.host.reduce(call, data, root)

    def all_gather(self, call: Call, slots: list[Array]) -> None:
        self.host.all_gather(call, slots)

    def gather(self, call: Call, mine: Array, slots: list[Array] | None, root: int) -> None:
        self.host.gather(call, mine, slots, root)

    def scatter(self, call: Call, out: Array, slots: list[Array] | None, root: int) -> None:
        self.host.scatter(call, out, slots, root)

    def reduce_scatter(self, call: Call, chunks: list[Array]) -> None:
        self.host.reduce_scatter(call, chunks)

    def all_to_all(self, call: Call, outs: list[Array], ins: list[Array]) -> None:
        self.host.all_to_all(call, outs, ins)

    def barrier(self, call: Call) -> None:
        self.host.barrier(call)

    def settle(self) -> None:
        self.device.settle()
        self.host.settle()

    def close(self) -> None:
        self.device.close()
        self.host.close()

