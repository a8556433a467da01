"""Every engine passes one conformance table (``rankwise.testing.engines``), in-process with
ranks as threads, in seconds; an engine that mistranslates a failure fails it."""

from __future__ import annotations

from typing import Any

import pytest

from rankwise.core.group import ProcessGroup
from rankwise.engines.base import Array, Call, DeadlinePassed, Engine, EngineFact
from rankwise.errors import DistError
from rankwise.testing.engines import _peer_gone, check_engine


def _message(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    return group.messages


def _shm(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    from rankwise.engines.shm_engine import ShmEngine

    return ShmEngine.create(group, store, timeout)


def _torch_gloo(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    pytest.importorskip("torch")
    from rankwise.engines.torch.engine import TorchEngine

    return TorchEngine.create(group, store, timeout)


class _TensorFed:
    """Hands ``inner`` CPU torch tensors sharing the API's arrays: how the staging wrapper
    (``engines.device.staged``, built for CUDA tensors) runs without a GPU."""

    def __init__(self, inner: Any, base: Engine) -> None:
        self.inner = inner
        self.base = base  #: the engine ``inner`` wraps: it owns what settle/close release
        self.name, self.serial, self.framed = inner.name, inner.serial, inner.framed

    def __getattr__(self, op: str) -> Any:
        import torch

        if op in ("settle", "close", "caps", "device"):
            return getattr(self.base if op in ("settle", "close") else self.inner, op)
        method = getattr(self.inner, op)

        def fed(call: Call, *args: Any) -> None:
            def t(a: Any) -> Any:
                if isinstance(a, list):
                    return [t(x) for x in a]
                return torch.from_numpy(a) if hasattr(a, "dtype") else a
            method(call, *[t(a) for a in args])

        return fed


def _staged(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    pytest.importorskip("torch")
    from rankwise.engines.device.staged import Staged

    base = _shm(group, store, timeout)
    return _TensorFed(Staged(base), base)


def _nccl_stand_in(group: ProcessGroup, store: Any, timeout: float) -> Engine:
    """The NCCL engine's CPU stand-in (``RANKWISE_TENSOR_PATH=device``): the engine class
    ``engines.nccl`` builds on a GPU, with its book on the process's ledger and its
    inline ``async_op``, over torch's gloo and host waits instead of streams."""
    torch = pytest.importorskip("torch")
    from rankwise.engines.torch.engine import TorchEngine
    from rankwise.engines.torch.nccl import STAND_IN, first_collective
    from rankwise.engines.torch.streams import HostStreams
    from rankwise.engines.torch.tensors import DeviceTensors

    engine = TorchEngine.create(group, store, timeout, prefix="device", name=STAND_IN,
                                tensors=DeviceTensors(torch.device("cpu")),
                                streams=HostStreams())
    first_collective(engine, timeout)
    return _TensorFed(engine, engine)


@pytest.mark.parametrize("make", [_message, _shm, _torch_gloo, _staged, _nccl_stand_in],
                         ids=["tcp", "shm", "torch-gloo", "staged-on-shm", "nccl-stand-in"])
def test_every_engine_passes_the_table(make: Any) -> None:
    check_engine(make)


def test_the_message_engine_passes_the_table_with_its_tree_all_reduce_and_barrier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # what a crowded job (more ranks than CPUs) runs for small messages. At 5 ranks (leaves,
    # inner ranks, an uneven tree) without the failure cases: thread-ranks that raise end
    # without the goodbye a process sends, so a rank two hops from a leaver would time out
    # there, with recursive doubling too
    from rankwise.core import messages

    monkeypatch.setattr(messages, "ALLREDUCE_ALGORITHM", "tree")
    check_engine(_message)
    check_engine(_message, size=5, ops=("all_reduce", "barrier"), failures=False)


def test_three_ranks_on_shared_memory() -> None:
    check_engine(_shm, size=3, dtypes=("float32", "int64"))


class _Mistranslating:
    """Wraps an engine and reports every failure of its all_reduce as a timeout."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name, self.serial, self.framed = inner.name, inner.serial, inner.framed

    def all_reduce(self, call: Call, data: Array) -> None:
        try:
            self.inner.all_reduce(call, data)
        except (EngineFact, DistError) as exc:
            raise DeadlinePassed(" (mistranslated)", str(exc)) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_engine_that_mistranslates_a_failure_fails_the_check() -> None:
    def make(group: ProcessGroup, store: Any, timeout: float) -> Engine:
        return _Mistranslating(_shm(group, store, timeout))

    check_engine(make, ops=("all_reduce",), dtypes=("float32",), failures=False)  # sane
    with pytest.raises(AssertionError, match="should raise (CollectiveMismatch|PeerFailure)"):
        check_engine(make, ops=("all_reduce",), dtypes=("float32",))


def test_a_mistranslated_failure_raised_by_work_wait_fails_the_check() -> None:
    def make(group: ProcessGroup, store: Any, timeout: float) -> Engine:
        return _Mistranslating(_shm(group, store, timeout))

    with pytest.raises(AssertionError, match="async_op=True: a peer that left: rank 0 "
                                             "should raise PeerFailure"):
        _peer_gone(make, 2, 60.0, is_async=True)


class _Undeclared:
    """Wraps an engine but declares no ``caps`` (what the call path reads of it)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name, self.serial, self.framed = inner.name, inner.serial, inner.framed

    def __getattr__(self, name: str) -> Any:
        if name == "caps":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_an_engine_that_declares_no_caps_fails_the_check() -> None:
    def make(group: ProcessGroup, store: Any, timeout: float) -> Engine:
        return _Undeclared(_shm(group, store, timeout))

    with pytest.raises(AssertionError, match="declares no Engine.caps"):
        check_engine(make, ops=("all_reduce",), dtypes=("float32",), failures=False)
