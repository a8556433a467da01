"""The gradient reducer: all_reduce each bucket as soon as backward has filled it.

Life of one synchronised iteration:

1. ``prepare_for_backward`` (from DDP's forward) arms the hooks.
2. Each parameter's post-accumulate-grad hook copies its gradient, pre-divided by the
   divisor (the world size), into its bucket's flat buffer. The first hook of a backward
   queues :meth:`Reducer._finalize` on the autograd engine and, with unused-parameter
   detection, marks the unused parameters ready (zeros) and launches the all_reduce of
   the "who used what" map.
3. When a bucket's last gradient arrives, its all_reduce starts (``async_op=True``) while
   backward goes on. Buckets always start in index order, whatever order they fill in,
   so every rank issues the same sequence of collectives.
4. ``_finalize`` runs when backward ends: it launches what is left, waits for every
   bucket and copies the averages back into ``.grad`` (or leaves them in place when the
   gradients are bucket views).

Pre-dividing (as torch does) keeps the sum from overflowing low-precision dtypes and
lets the copy into the bucket do the division in the same pass.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rankwise.api.grad_bucket import GradBucket
from rankwise.nn._buckets import FIRST_BUCKET_BYTES, Bucket, build_buckets
from rankwise.nn._comm import comm
from rankwise.nn._comm_hook import CommHook
from rankwise.nn._errors import DDPError
from rankwise.nn._graph import reachable_leaves

__all__ = ["Reducer", "ReducerStatistics"]


@dataclass(frozen=True)
class ReducerStatistics:
    """What the reducer did; ``exposed_wait_s`` is communication backward could not hide."""

    buckets: int
    bucket_bytes: tuple[int, ...]
    iterations: int
    last_backward_s: float
    last_exposed_wait_s: float
    total_backward_s: float
    total_exposed_wait_s: float


class Reducer:
    """Averages the gradients of ``params`` across ``group`` during backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: Any,
        bucket_cap_bytes: int,
        *,
        find_unused: bool,
        static_graph: bool,
        grad_as_view: bool,
    ) -> None:
        self._params = list(params)
        self._names = list(names)
        self._group = group
        self._find_unused = find_unused or static_graph
        self._static_graph = static_graph
        self._grad_as_view = grad_as_view
        self.divisor = comm().get_world_size(group)
        caps = [min(FIRST_BUCKET_BYTES, bucket_cap_bytes), bucket_cap_bytes]
        order = list(reversed(range(len(self._params))))
        self.buckets: list[Bucket] = build_buckets(self._params, order, caps)
        self._where: dict[int, tuple[Bucket, int]] = {
            index: (bucket, slot)
            for bucket in self.buckets
            for slot, index in enumerate(bucket.params)
        }
        self._index_of_leaf = {id(p): i for i, p in enumerate(self._params)}
        self._ready = [False] * len(self._params)
        self._armed = False
        self._in_backward = False
        self._next_bucket = 0
        self._unused: list[int] = []
        self._static_unused: list[int] | None = None
        self._used_map = torch.zeros(len(self._params), dtype=torch.int32)
        self._used_map_work: Any = None
        self._iterations = 0
        self._comm_hook: CommHook | None = None
        self._backward_start = 0.0
        self._last_backward_s = 0.0
        self._last_wait_s = 0.0
        self._total_backward_s = 0.0
        self._total_wait_s = 0.0
        self._handles = [
            p.register_post_accumulate_grad_hook(_hook_for(self, i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self._params)
        ]

    # -- called by DistributedDataParallel ---------------------------------------------

    def prepare_for_backward(self) -> None:
        """Arm the hooks for the backward of the forward that is about to run."""
        if self._in_backward:
            raise DDPError(
                "Expected to have finished reduction in the prior iteration before starting "
                "a new one: the previous backward stopped part-way (it raised?), so this "
                "rank's gradients are out of step with the other ranks. Do not continue "
                "training after a failed backward; restart the job."
            )
        self._armed = True
        self._unused = []

    def find_unused(self, outputs: Any) -> None:
        """Record which parameters the outputs cannot reach (they get zero gradients)."""
        if not self._find_unused:
            return
        if self._static_graph and self._static_unused is not None:
            self._unused = self._static_unused
            return
        reachable = reachable_leaves(outputs)
        self._unused = [i for i, p in enumerate(self._params) if id(p) not in reachable]
        if self._static_graph:
            self._static_unused = self._unused

    def disarm(self) -> None:
        """Let the next backward accumulate locally (``no_sync``, or no forward armed it)."""
        self._armed = False

    def register_comm_hook(self, hook: CommHook) -> None:
        """Reduce every bucket with ``hook`` instead of pre-dividing and all-reducing."""
        if self._comm_hook is not None:
            raise DDPError("register_comm_hook can only be called once per DDP model")
        if self._iterations or self._in_backward:
            raise DDPError(
                "register_comm_hook must be called before the first backward: ranks that "
                "switch reduction part-way would average different things"
            )
        self._comm_hook = hook

    def remove_hooks(self) -> None:
        """Detach from the parameters (the DDP wrapper is going away)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def shadow_iteration(self) -> None:
        """Take part in one iteration's collectives with zero gradients (for join).

        Issues exactly the collectives a real synchronised backward issues, in the same
        order, so ranks that still have data can finish their step.
        """
        dist = comm()
        if self._find_unused:
            self._used_map.zero_()
            dist.all_reduce(self._used_map, group=self._group)
        works = []
        for bucket in self.buckets:
            bucket.buffer.zero_()
            works.append(self._reduce(bucket))
        for work in works:
            work.wait()

    def statistics(self) -> ReducerStatistics:
        """Counters for benchmarks and debugging (cheap; no communication)."""
        return ReducerStatistics(
            buckets=len(self.buckets),
            bucket_bytes=tuple(b.buffer.numel() * b.buffer.element_size() for b in self.buckets),
            iterations=self._iterations,
            last_backward_s=self._last_backward_s,
            last_exposed_wait_s=self._last_wait_s,
            total_backward_s=self._total_backward_s,
            total_exposed_wait_s=self._total_wait_s,
        )

    # -- backward ------------------------------------------------------------------------

    def _on_grad_ready(self, index: int) -> None:
        if not self._armed:
            return
        if not self._in_backward:
            self._start_backward()
        self._mark_ready(index, has_grad=True)

    def _start_backward(self) -> None:
        self._in_backward = True
        self._backward_start = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self._find_unused:
            self._used_map.fill_(1)
            for index in self._unused:
                self._used_map[index] = 0
            self._used_map_work = comm().all_reduce(
                self._used_map, group=self._group, async_op=True
            )
            for index in self._unused:
                self._mark_ready(index, has_grad=False)

    def _mark_ready(self, index: int, *, has_grad: bool) -> None:
        if self._ready[index]:
            raise DDPError(
                f"Parameter {self._names[index]!r} has been marked as ready twice in one "
                "backward: it is used by more than one backward per forward, or "
                "find_unused_parameters=True thought it unused. Call backward once per "
                "forward, or use no_sync() for all but the last backward."
            )
        self._ready[index] = True
        bucket, slot = self._where[index]
        view = bucket.views[slot]
        grad = self._params[index].grad if has_grad else None
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self._grad_as_view and grad.data_ptr() == view.data_ptr():
                view.div_(self._pre_divisor())
            else:
                torch.div(grad, self._pre_divisor(), out=view)
                if self._grad_as_view:
                    self._params[index].grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _pre_divisor(self) -> int:
        """What gradients are divided by on their way into a bucket: a comm hook gets
        them undivided (it averages itself, as in torch)."""
        return 1 if self._comm_hook is not None else self.divisor

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.pending:
                return
            bucket.work = self._reduce(bucket)
            self._next_bucket += 1

    def _reduce(self, bucket: Bucket) -> Any:
        """Start reducing one bucket: the registered comm hook, else an async all_reduce."""
        if self._comm_hook is None:
            return comm().all_reduce(bucket.buffer, group=self._group, async_op=True)
        grad_bucket = GradBucket(
            bucket.index,
            bucket.buffer,
            list(bucket.views),
            [self._params[i] for i in bucket.params],
            is_last=bucket.index == len(self.buckets) - 1,
        )
        return self._comm_hook.launch(grad_bucket)

    def _finalize(self) -> None:
        """End of backward: wait for every bucket and hand the averages to ``.grad``."""
        try:
            backward_end = time.perf_counter()
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            for index in missing:  # zeros keep every rank's collective sequence equal
                self._mark_ready(index, has_grad=False)
            if self._used_map_work is not None:
                self._used_map_work.wait()
            for bucket in self.buckets:
                bucket.work.wait()
            waited = time.perf_counter() - backward_end
            self._record(backward_end - self._backward_start, waited)
            if missing and not self._find_unused:
                raise DDPError(self._unused_message(missing))
            self._write_back()
        finally:
            self._reset()

    def _write_back(self) -> None:
        globally_used = self._used_map if self._find_unused else None
        with torch.no_grad():
            for bucket in self.buckets:
                for slot, index in enumerate(bucket.params):
                    if globally_used is not None and not globally_used[index]:
                        continue  # nobody computed it: leave .grad as torch would
                    param, view = self._params[index], bucket.views[slot]
                    if self._grad_as_view:
                        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                            param.grad = view
                    elif param.grad is None:
                        param.grad = view.clone()
                    else:
                        param.grad.copy_(view)

    def _record(self, backward_s: float, waited_s: float) -> None:
        self._iterations += 1
        self._last_backward_s, self._last_wait_s = backward_s, waited_s
        self._total_backward_s += backward_s
        self._total_wait_s += waited_s

    def _reset(self) -> None:
        self._ready = [False] * len(self._params)
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0
        self._used_map_work = None
        self._in_backward = False
        self._armed = False

    def _unused_message(self, missing: Sequence[int]) -> str:
        names = ", ".join(repr(self._names[i]) for i in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        return (
            "Expected every parameter to receive a gradient, but these were not used in "
            f"producing the loss on this rank: {names}{more}. Pass "
            "find_unused_parameters=True to DistributedDataParallel, or make sure all "
            "forward outputs participate in the loss. (The other ranks were sent zeros "
            "for them, so nobody hangs; this step's gradients are not applied here.)"
        )


def _hook_for(reducer: Reducer, index: int) -> Any:
    """A post-accumulate-grad hook that does not keep the reducer alive."""
    ref = weakref.ref(reducer)

    def hook(_param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._on_grad_ready(index)

    return hook
