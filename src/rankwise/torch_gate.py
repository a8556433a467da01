"""The torch versions rankwise's torch parts run on, checked when they are imported.

Why a gate: rankwise drives torch's process groups below ``init_process_group``
(``ProcessGroupGloo``/``ProcessGroupNCCL`` built directly, their private options,
``abort``/``shutdown``, a Python ``ProcessGroup`` registered as a backend, DDP's
reducer hooks). Those are not public API and change between torch minors, so a torch
outside the range it was built and checked on fails with one line naming the range,
never with an AttributeError deep inside a collective.

The range (also in pyproject's ``torch`` extra and the README): 2.13 is what CI runs;
2.11 is the GPU machine's, which ``scripts/gpu-check`` proves; ``scripts/torch-matrix``
runs every torch-facing test on each minor in throwaway venvs. Where the minors differ
in what rankwise touches, the code reads what each offers (PREMUL_SUM's factor: 2.13's
``.factor``, 2.11/2.12's pickled state; 2.14 asks a group's ``_get_backend(device)`` in
``batch_isend_irecv``, which the backend answers; 2.15 skips groups without a C++
``Backend`` in its flight recorder and health check, see docs/design.md, "The seam torch
sees"). ``RANKWISE_TORCH_ANY=1`` skips the
check (at your own risk: to try a newer torch).
"""

from __future__ import annotations

import re
from typing import Any

from . import settings

__all__ = ["SUPPORTED", "check_torch", "supported"]

#: the torch versions rankwise runs on: [low, high)
LOW, HIGH = (2, 11), (2, 16)
SUPPORTED = f">={LOW[0]}.{LOW[1]},<{HIGH[0]}.{HIGH[1]}"
ANY_ENV = "RANKWISE_TORCH_ANY"


def supported(version: str) -> bool:
    """Whether torch ``version`` ("2.11.0+cu130", "2.13.0a0+git...") is in the range."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return False
    v = (int(m.group(1)), int(m.group(2)))
    return LOW <= v < HIGH


def check_torch(torch: Any = None) -> None:
    """Refuse (``ImportError``, one line) a torch outside ``SUPPORTED``."""
    if settings.flag(ANY_ENV):
        return
    if torch is None:
        import torch
    version = str(getattr(torch, "__version__", "?"))
    if not supported(version):
        raise ImportError(f"rankwise supports torch {SUPPORTED}; this is torch {version} "
                          f"(install a torch in that range, or set {ANY_ENV}=1 to try it)")
