"""``SyncBatchNorm`` that works on CPU tensors, over any torch.distributed backend.

Why: torch 2.13's ``nn.SyncBatchNorm`` raises "SyncBatchNorm expected input tensor to be
on GPU" for CPU input as soon as a process group is initialized (its kernels
``batch_norm_stats`` / ``batch_norm_gather_stats_with_counts`` have no CPU version).
This drop-in has the same arguments, state and results, and its training forward
computes the batch statistics of the whole group:
one all-reduce of ``[sum, sum of squares, count]`` per channel. The all-reduce is
differentiable (its backward all-reduces the gradient), so autograd yields exactly the
synchronized gradient torch's CUDA kernels compute. Eval mode, a group of one, or no
initialized group: plain ``F.batch_norm``, as torch does.

It is deliberately *not* a subclass of ``nn.SyncBatchNorm``: torch's DDP refuses any such
layer in a CPU module ("SyncBatchNorm layers only work with GPU modules").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        tdist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        tdist.all_reduce(out, group=ctx.group)
        return out, None


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.SyncBatchNorm`` with the same arguments, buffers and results, on CPU."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: torch.Tensor) -> None:
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked.item()) if self.momentum is None
                      else self.momentum)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group = self.process_group or tdist.group.WORLD
        if not (bn_training and self.training and tdist.is_available()
                and tdist.is_initialized() and tdist.get_world_size(group) > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return self._synced(input, running_mean, running_var, factor, group)

    def _synced(self, x: torch.Tensor, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, factor: float, group: Any) -> torch.Tensor:
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]
        local_n = x.numel() // channels
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_full((1,), float(local_n))])
        stats = _AllReduceSum.apply(stats, group)  # type: ignore[no-untyped-call]
        n = stats[-1]
        mean = stats[:channels] / n
        var = stats[channels:2 * channels] / n - mean * mean  # biased, as in normalization
        shape = [1, channels] + [1] * (x.dim() - 2)
        y: torch.Tensor = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
            if running_var is not None:
                unbiased = var.detach() * (n / (n - 1).clamp(min=1))
                running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Like torch's, but the layers it makes are this CPU-capable class."""
        return convert_sync_batchnorm(module, process_group)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """torch's ``SyncBatchNorm.convert_sync_batchnorm``, making rankwise's CPU drop-in
    (``BatchNorm*d`` layers and torch's own ``SyncBatchNorm`` alike)."""
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
        module, process_group)
    return _retype(converted)


def _retype(module: nn.Module) -> nn.Module:
    """Switch every ``nn.SyncBatchNorm`` to this class in place: both are ``_BatchNorm``s
    with a ``process_group``, so parameters, buffers and hooks stay as they are."""
    for m in module.modules():
        if type(m) is nn.SyncBatchNorm:
            m.__class__ = SyncBatchNorm  # type: ignore[assignment]
    return module
