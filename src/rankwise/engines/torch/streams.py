"""Ordering work after a device collective without blocking the host: the stream seam.

Why a seam: on CUDA, "wait for the collective" means "the current stream waits for the
collective's kernel" (torch's ``WorkNCCL.wait()``, an event wait on the stream), which
the host never blocks on; on the test stand-in (torch's gloo over CPU tensors) there is
no stream, so waiting means the host waits until the ledger's pass over the book settles
the work. The engine uses one interface (``Streams``) for both, and tests pass a fake
one; what a device call does with it is ``device_waits``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ...errors import DistTimeout

if TYPE_CHECKING:
    from .work_book import Pending

__all__ = ["CudaStreams", "HostStreams", "Streams"]

#: seconds the host stand-in waits past a call's deadline for the book's verdict
_MARGIN = 30.0


class Streams:
    """The stream operations the device engine needs (CUDA: ``CudaStreams``)."""

    #: a group's collectives finish in the order they were enqueued (NCCL: one stream
    #: per communicator), so the book's pass need not ask each one (``WorkBook.watch``)
    in_order = False

    def current(self) -> Any:
        """The calling thread's current stream (None: no streams here)."""
        return None

    def side(self) -> Any:
        """The engine's side stream for async calls (one: the async worker is serial)."""
        return None

    def follow(self, stream: Any, other: Any) -> None:
        """``stream`` waits for what is queued on ``other`` now (no host block)."""

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` this thread's current stream inside the block."""
        yield

    def record(self, stream: Any) -> Any:
        """An event marking what is queued on ``stream`` now."""
        return None

    def wait_event(self, event: Any) -> None:
        """The current stream waits for ``event`` (no host block)."""

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        """The host waits for ``event`` (only where the work is known to be done)."""

    def order(self, p: Pending) -> None:
        """Whatever runs next on this thread sees the collective's result."""
        raise NotImplementedError


class CudaStreams(Streams):
    """Real CUDA streams of ``device``; ``order`` is torch's ``WorkNCCL.wait()``: the
    current stream waits for the collective's end event, the host goes on."""

    in_order = True

    def __init__(self, device: Any) -> None:
        import torch

        self.torch: Any = torch
        self.device = device
        self._side: Any = None

    def current(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def side(self) -> Any:
        if self._side is None:
            self._side = self.torch.cuda.Stream(device=self.device)
        return self._side

    def follow(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with self.torch.cuda.stream(stream):
            yield

    def record(self, stream: Any) -> Any:
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, event: Any) -> None:
        if event is not None:
            self.current().wait_event(event)

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def order(self, p: Pending) -> None:
        if p.error is not None:
            raise p.error
        p.work.wait()  # a stream wait: the host does not block (no TORCH_NCCL_BLOCKING_WAIT)


class HostStreams(Streams):
    """No streams (the stand-in's CPU tensors): ``order`` blocks the host until the
    book settles the work, bounded, then raises its error or the op's own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

    def order(self, p: Pending) -> None:
        end = p.call.deadline + _MARGIN
        delay = 20e-6
        while not p.done():  # polled here: the ledger's pass may be much later
            left = end - self.clock()
            if left <= 0:
                raise DistTimeout(f"{p.call.describe()}: no verdict from the book "
                                  f"{_MARGIN:.0f}s past the deadline")
            if self.clock() >= p.call.deadline:
                p.book.kick(0.0)  # past the deadline: the verdict is due now
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.005)
        if p.error is not None:
            raise p.error
        p.work.wait()  # done: raises the op's own error, if any
        p.settle(None)  # seen done here: its future need not wait for the ledger
