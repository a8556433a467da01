"""``rankwise doctor``: find the environment problems that make distributed jobs fail.

Each check is a small function from :class:`Inputs` (environment mapping, interfaces,
/dev/shm space, limits, CPUs, and probes for the network and GPUs, all fakeable) to
:class:`Finding` values (severity, what, evidence, fix). ``gather()`` reads this machine;
``run_checks()`` runs them; the CLI (``rankwise doctor``) prints them, and
``init_process_group`` adds the relevant ones to its error when it fails.

Modules: ``gpu`` (CUDA_VISIBLE_DEVICES, LOCAL_RANK, ranks sharing a GPU), ``network``
(interface variables, MASTER_ADDR, hostname, MASTER_PORT), ``resources`` (/dev/shm,
open files, CPUs per rank), ``security`` (token file), ``jobenv`` (rank variables).
"""

from __future__ import annotations

from .findings import Finding, Severity
from .hook import explain_init_failure
from .inputs import Cpus, Inputs, ShmSpace, gather
from .probes import GpuProbes, NetProbes, PortState
from .report import render_json, render_text
from .run import CHECKS, run_checks

__all__ = [
    "CHECKS",
    "Cpus",
    "Finding",
    "GpuProbes",
    "Inputs",
    "NetProbes",
    "PortState",
    "Severity",
    "ShmSpace",
    "explain_init_failure",
    "gather",
    "render_json",
    "render_text",
    "run_checks",
]
