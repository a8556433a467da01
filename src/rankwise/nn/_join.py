"""Uneven inputs: ``with ddp.join(): ...`` lets ranks run out of batches at different steps.

Without it, a rank that finishes its data early stops issuing gradient all_reduces and
the other ranks wait for it forever. Under join (torch's semantics), every forward first
does a small all_reduce saying "I am still training, and will sync gradients"; a rank
whose loop has ended answers "joined" from the context's exit and *shadows* each
iteration of the others: it broadcasts buffers with them and all-reduces zero
gradients, until nobody is left training. Then the ranks that trained longest broadcast
their parameters, so every rank leaves the context with the same model.

With ``throw_on_early_termination=True`` the first exhausted rank instead makes every
rank raise :class:`DDPError` at its next synchronisation point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rankwise.nn._comm import comm
from rankwise.nn._errors import DDPError
from rankwise.nn._sync import broadcast_tensors

if TYPE_CHECKING:
    from rankwise.nn.ddp import DistributedDataParallel

__all__ = ["JoinState"]


class JoinState:
    """One ``ddp.join()`` context: the handshake both sides of an iteration perform."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        *,
        divide_by_initial_world_size: bool,
        throw_on_early_termination: bool,
    ) -> None:
        self._ddp = ddp
        self._divide_by_initial = divide_by_initial_world_size
        self._throw = throw_on_early_termination
        dist = comm()
        self._group = ddp.process_group
        self._world = dist.get_world_size(self._group)
        self._me = dist.get_rank(self._group)
        self._last_active: list[int] = []

    def _handshake(self, training: bool, will_sync: bool) -> tuple[list[int], bool]:
        """All-reduce ``[one-hot of active ranks..., sync flag]``; return (active, sync)."""
        flags = torch.zeros(self._world + 1, dtype=torch.int64)
        if training:
            flags[self._me] = 1
            flags[self._world] = int(will_sync)
        comm().all_reduce(flags, group=self._group)
        active = [r for r in range(self._world) if flags[r] > 0]
        if active:
            self._last_active = active
        if active and len(active) < self._world and self._throw:
            gone = sorted(set(range(self._world)) - set(active))
            raise DDPError(
                f"rank(s) {gone} of the process group ran out of inputs while rank(s) "
                f"{active} still have some (join(throw_on_early_termination=True)). Give "
                "every rank the same number of batches (DistributedSampler with "
                "drop_last=True), or use join() without throw_on_early_termination."
            )
        return active, bool(flags[self._world] > 0)

    def before_forward(self, will_sync: bool) -> int:
        """Handshake of a training rank; returns the global rank to take buffers from."""
        active, _ = self._handshake(training=True, will_sync=will_sync)
        if not self._divide_by_initial:
            self._ddp._live_reducer().divisor = len(active)
        return self._ddp.group_ranks[active[0]]

    def shadow_until_all_joined(self) -> None:
        """Called on context exit: mirror the others' iterations, then agree on the model."""
        ddp = self._ddp
        while True:
            active, sync = self._handshake(training=False, will_sync=False)
            if not active:
                break
            if ddp.syncs_buffers():
                broadcast_tensors(ddp.module_buffers(), ddp.group_ranks[active[0]], self._group)
            if sync:
                ddp._live_reducer().shadow_iteration()
        if self._last_active:
            source = ddp.group_ranks[self._last_active[0]]
            broadcast_tensors(ddp.module_states(), source, self._group)
        ddp._live_reducer().divisor = self._world
