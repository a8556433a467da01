"""Engines for tensors that stay on a device: the CPU/NCCL pair (``pair``) and the wrapper
that stages device tensors through host memory (``staged``)."""
