"""Fakes for the device path's tests (``test_device_hot_activity.py``): ``CudaStreams``
over a ``torch.cuda`` that has nothing to do."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def fake_cuda_streams() -> Any:
    """The real ``CudaStreams`` (the NCCL engine's stream order: each work's own
    ``wait()``) over stand-in streams and events: no GPU, no CUDA calls."""
    import torch

    from rankwise.engines.torch.streams import CudaStreams

    streams = CudaStreams(torch.device("cpu"))
    cuda = SimpleNamespace(current_stream=lambda device=None: None,
                           Stream=lambda device=None: None, Event=lambda: None)
    streams.torch = SimpleNamespace(cuda=cuda)
    return streams
