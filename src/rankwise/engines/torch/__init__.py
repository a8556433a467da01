"""Engines whose data moves through torch.distributed (torch-gloo and NCCL) while rankwise
checks every call. Import torch lazily: this package must import without torch."""
