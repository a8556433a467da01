"""Neural-network helpers on top of rankwise's collectives (needs torch).

``import rankwise`` stays torch-free; importing this package imports torch.

- :class:`DistributedDataParallel` — gradient averaging overlapped with backward,
  ``no_sync()`` accumulation, ``join()`` for uneven inputs.
"""

from rankwise.torch_gate import check_torch

check_torch()  # before any torch internals are touched

from rankwise.nn import parallel
from rankwise.nn._errors import DDPError, ParameterMismatch
from rankwise.nn._reducer import ReducerStatistics
from rankwise.nn.ddp import DistributedDataParallel

__all__ = [
    "DDPError",
    "DistributedDataParallel",
    "ParameterMismatch",
    "ReducerStatistics",
    "parallel",
]
