"""CUDA tensors on an engine that moves host memory: staged through host copies.

Why: torch's gloo accepts CUDA tensors (it copies them to the host and back), so a
drop-in script that says ``init_process_group("gloo")`` and all-reduces CUDA gradients
must work on rankwise's CPU engines (tcp, shm, torch-gloo) too. One wrapper serves every
collective of every CPU engine, blocking or ``async_op``: each input is copied to the
host, the wrapped engine runs the call as it would for numpy arrays, and each output is
copied back into its tensor before the call counts as done. Only what the engine reads
is copied in, and only what the call writes on this rank is copied back.
"""

from __future__ import annotations

from typing import Any

from ...wire.device import host_empty, to_host, to_tensor
from ..base import Call, Engine

__all__ = ["Staged"]


class Staged:
    """``inner`` (a host-memory engine) run on flat torch tensors via host copies."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        #: the wrapped engine's (a host engine's: nothing on a stream; its ring check,
        #: if its data is not rankwise's, is the one its own calls have)
        self.caps = inner.caps
        self.name = inner.name
        self.serial = inner.serial
        self.framed = inner.framed

    def broadcast(self, call: Call, data: Any, root: int) -> None:
        h = to_host(data, call.dtype) if call.rank == root else host_empty(data, call.dtype)
        self.inner.broadcast(call, h, root)
        if call.rank != root:
            to_tensor(h, data)

    def all_reduce(self, call: Call, data: Any) -> None:
        h = to_host(data, call.dtype)
        self.inner.all_reduce(call, h)
        to_tensor(h, data)

    def reduce(self, call: Call, data: Any, root: int) -> None:
        h = to_host(data, call.dtype)
        self.inner.reduce(call, h, root)
        if call.rank == root:
            to_tensor(h, data)

    def all_gather(self, call: Call, slots: list[Any]) -> None:
        me = call.rank
        hs = [to_host(s, call.dtype) if i == me else host_empty(s, call.dtype)
              for i, s in enumerate(slots)]
        self.inner.all_gather(call, hs)
        for i, (h, s) in enumerate(zip(hs, slots, strict=True)):
            if i != me:
                to_tensor(h, s)

    def gather(self, call: Call, mine: Any, slots: list[Any] | None, root: int) -> None:
        hs = None if slots is None else [host_empty(s, call.dtype) for s in slots]
        self.inner.gather(call, to_host(mine, call.dtype), hs, root)
        if slots is not None and hs is not None:
            for h, s in zip(hs, slots, strict=True):
                to_tensor(h, s)

    def scatter(self, call: Call, out: Any, slots: list[Any] | None, root: int) -> None:
        hs = None if slots is None else [to_host(s, call.dtype) for s in slots]
        h = host_empty(out, call.dtype)
        self.inner.scatter(call, h, hs, root)
        to_tensor(h, out)

    def reduce_scatter(self, call: Call, chunks: list[Any]) -> None:
        hs = [to_host(c, call.dtype) for c in chunks]
        self.inner.reduce_scatter(call, hs)
        to_tensor(hs[call.rank], chunks[call.rank])

    def all_to_all(self, call: Call, outs: list[Any], ins: list[Any]) -> None:
        ho = [host_empty(o, call.dtype) for o in outs]
        self.inner.all_to_all(call, ho, [to_host(i, call.dtype) for i in ins])
        for h, o in zip(ho, outs, strict=True):
            to_tensor(h, o)

    def barrier(self, call: Call) -> None:
        self.inner.barrier(call)

    def settle(self) -> None:
        """Nothing of its own: the wrapped engine is the group's and settled with it."""

    def close(self) -> None:
        """Nothing of its own: the wrapped engine is the group's and closed with it."""
