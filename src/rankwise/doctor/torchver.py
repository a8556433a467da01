"""The torch version against the range rankwise's torch parts run on: a torch outside it
refuses ``import rankwise.torch`` at the start of a job, so the doctor says so first."""

from __future__ import annotations

from ..torch_gate import ANY_ENV, SUPPORTED, supported
from .findings import Finding, Severity
from .inputs import Inputs

__all__ = ["check_torch_version"]

CHECK = "torch"


def check_torch_version(inp: Inputs) -> list[Finding]:
    version = inp.gpus.torch_version()
    if version is None:
        return [Finding(CHECK, Severity.INFO, "torch is not installed: rankwise's torch "
                        "parts (backend \"rankwise\", rankwise.nn) are unavailable")]
    if supported(version):
        return [Finding(CHECK, Severity.INFO, f"torch {version} (rankwise supports {SUPPORTED})")]
    overridden = inp.env.get(ANY_ENV, "").strip() in ("1", "true", "yes")
    return [Finding(
        CHECK, Severity.WARNING if overridden else Severity.ERROR,
        f"torch {version} is outside the range rankwise supports ({SUPPORTED})",
        f"torch {version} installed" + (f"; {ANY_ENV} is set, so it is tried anyway"
                                        if overridden else ""),
        f"install a torch in that range (pip install 'torch{SUPPORTED}'); "
        f"`import rankwise.torch` refuses this one" + ("" if overridden else
                                                       f" unless {ANY_ENV}=1"))]
