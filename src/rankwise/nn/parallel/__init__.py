"""``rankwise.nn.parallel``: same place as ``torch.nn.parallel`` for drop-in imports."""

from rankwise.nn.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
