"""The torch backend's conversions, in one process (issue 35): views that leave a tensor's
storage as it was, PREMUL_SUM's factor on every torch in range, per-call timeouts read
from torch's options."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as tdist

from rankwise.api.views import TensorViews
from rankwise.errors import InvalidArgument
from rankwise.torch import _backend
from rankwise.wire.buffers import as_buffer
from rankwise.wire.reduce_op import coerce_reduce_op
from rankwise.wire.serialize import dumps, loads

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_viewed_tensor_stays_resizable(dtype: torch.dtype) -> None:
    """``Tensor.numpy()`` marks storage non-resizable for good; FSDP1 then fails to free."""
    t = torch.ones(4, dtype=dtype)
    buf = as_buffer(t, "tensor", writable=True)
    buf.array[0] = 0  # the view is the tensor's memory
    assert t[0].item() == 0
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0


def test_a_remembered_view_and_a_sent_object_leave_storage_resizable() -> None:
    views, t = TensorViews(), torch.ones(3)
    views.view(t, "tensor")
    assert loads(dumps({"t": t}))["t"].tolist() == [1.0, 1.0, 1.0]
    t.untyped_storage().resize_(0)


def test_a_conjugated_view_is_refused_by_name() -> None:
    lazy = torch.ones(2, dtype=torch.complex64).conj()
    with pytest.raises(InvalidArgument, match="resolve_conj"):
        as_buffer(lazy, "tensor")


class _OldPremul:
    """torch 2.11/2.12's ``_make_nccl_premul_sum(f)``: no ``factor``, a pickled state."""

    op = tdist.ReduceOp.RedOpType.PREMUL_SUM  # type: ignore[attr-defined]

    def __getstate__(self) -> Any:
        return (self.op, 0.25)


class _Options:
    def __init__(self, red: Any) -> None:
        self.reduceOp = red


def test_premul_sum_factor_without_the_factor_attribute() -> None:
    assert coerce_reduce_op(_OldPremul()).factor == 0.25
    assert _backend._reduce_op(_Options(_OldPremul())).factor == 0.25


def test_premul_sum_without_any_factor_says_so() -> None:
    class Opaque:
        op = _OldPremul.op

    with pytest.raises(InvalidArgument, match="does not expose the factor"):
        coerce_reduce_op(Opaque())


def test_only_a_set_timeout_bounds_a_call() -> None:
    unset = tdist.BarrierOptions()
    assert _backend._call_timeout((unset,), {}) is None
    chosen = tdist.BarrierOptions()
    chosen.timeout = timedelta(seconds=1.5)
    assert _backend._call_timeout((chosen,), {}) == 1.5
    assert _backend._call_timeout((), {"opts": chosen}) == 1.5
    assert _backend._call_timeout(([torch.ones(1)], [torch.ones(1)]), {}) is None


def test_a_failed_future_raises_in_python_and_where_cpp_reads_its_tensors() -> None:
    """``fail_future``: ``wait``/``value`` raise the error, and so does taking the value's
    tensors the way DDP's reducer does in C++ (pickling it): a value stored by
    ``Future.set_exception`` has none, and the reducer indexed the empty list (SIGSEGV)."""
    import torch._jit_internal as jit_internal

    from rankwise.errors import CollectiveMismatch
    from rankwise.torch._work import _Failed, fail_future

    future: Any = torch.futures.Future()
    error = CollectiveMismatch("rank 1 called all_reduce, rank 0 broadcast")
    fail_future(future, error)
    assert future.done()
    for read in (future.wait, future.value):
        with pytest.raises(CollectiveMismatch) as raised:
            read()
        assert raised.value is error
    with pytest.raises(CollectiveMismatch):
        jit_internal._extract_tensors(_Failed(error))
    # what set_exception leaves for C++: a value without tensors
    plain: Any = torch.futures.Future()
    plain.set_exception(ValueError("x"))
    assert jit_internal._extract_tensors(ValueError("x")) == []
