"""Data loading helpers for distributed training (needs torch).

- :class:`DistributedSampler` — each rank iterates a disjoint shard of the dataset,
  index-for-index identical to ``torch.utils.data.DistributedSampler``.

For ranks that run out of batches at different steps, wrap the training loop in
``ddp.join()`` (:meth:`rankwise.nn.DistributedDataParallel.join`), as with torch.
"""

from rankwise.utils.data.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
