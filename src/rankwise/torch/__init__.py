"""rankwise as a ``torch.distributed`` backend: ``import rankwise.torch``, then
``torch.distributed.init_process_group("rankwise")``.

torch's whole distributed stack (DDP, ``DistributedSampler``, object collectives,
distributed checkpoint, libraries that call ``torch.distributed`` directly) then runs on
rankwise's engines and checks: a collective that ranks disagree on raises
``rankwise.CollectiveMismatch`` naming each rank's call site in the user's code, a dead
peer raises ``PeerFailure`` naming it. Start it with ``rankwise run`` or torchrun; nothing
else is needed.

``SyncBatchNorm`` / ``convert_sync_batchnorm``: torch's ``nn.SyncBatchNorm`` refuses CPU
tensors; this drop-in does not (and works with backend ``"gloo"`` as well).
"""

from __future__ import annotations

from ..torch_gate import check_torch

check_torch()  # before any torch internals are touched

from ._backend import BACKEND_NAME, TorchProcessGroup
from ._register import install
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["BACKEND_NAME", "SyncBatchNorm", "TorchProcessGroup", "convert_sync_batchnorm"]

install()
