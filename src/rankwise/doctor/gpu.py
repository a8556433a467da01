"""GPU placement: CUDA_VISIBLE_DEVICES against the GPUs torch sees and against LOCAL_RANK,
and ranks that would end up sharing one GPU (NCCL refuses that: "Duplicate GPU detected")."""

from __future__ import annotations

from .findings import Finding, Severity
from .inputs import Inputs

__all__ = ["check_gpus"]

CHECK = "gpu"


def _listed(cvd: str) -> list[str]:
    return [item.strip() for item in cvd.split(",")]


def _visible_list_findings(cvd: str, physical: int | None) -> list[Finding]:
    """Problems of the CUDA_VISIBLE_DEVICES string itself."""
    items = _listed(cvd)
    found: list[Finding] = []
    seen: set[str] = set()
    for pos, item in enumerate(items):
        if item in seen:
            found.append(Finding(
                CHECK, Severity.ERROR, f"CUDA_VISIBLE_DEVICES lists GPU {item} twice",
                f"CUDA_VISIBLE_DEVICES={cvd}",
                "list each GPU once; ranks meant to have a GPU each would share one"))
        seen.add(item)
        if item.isdigit():
            if physical is not None and int(item) >= physical:
                found.append(Finding(
                    CHECK, Severity.ERROR,
                    f"CUDA_VISIBLE_DEVICES names GPU {item}, but this machine has {physical} "
                    f"GPU(s) (0..{physical - 1})",
                    f"CUDA_VISIBLE_DEVICES={cvd}; {physical} entries in /proc/driver/nvidia/gpus",
                    "CUDA hides every device from the first invalid entry on: list only "
                    "existing GPUs (see `nvidia-smi -L`)"))
        elif not item.startswith(("GPU-", "MIG-")) and not (item == "-1" and pos == 0):
            found.append(Finding(
                CHECK, Severity.ERROR, f"CUDA_VISIBLE_DEVICES has an invalid entry {item!r}",
                f"CUDA_VISIBLE_DEVICES={cvd!r}",
                "use comma-separated indices (0,1) or GPU-/MIG- UUIDs, without spaces or "
                "empty entries: CUDA hides every device from the first invalid entry on"))
    return found


def check_gpus(inp: Inputs) -> list[Finding]:
    cvd = inp.env.get("CUDA_VISIBLE_DEVICES")
    physical = inp.gpus.physical_count()
    count = inp.gpus.device_count()
    found: list[Finding] = []
    if cvd is not None and cvd.strip() not in ("", "-1"):
        found += _visible_list_findings(cvd, physical)
    if count is None:
        if cvd and cvd.strip() not in ("-1",) and physical:
            found.append(Finding(
                CHECK, Severity.WARNING,
                "CUDA_VISIBLE_DEVICES selects GPUs, but torch here cannot use CUDA",
                f"CUDA_VISIBLE_DEVICES={cvd}; {physical} NVIDIA GPU(s); torch is missing or a "
                "CPU-only build",
                "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"))
        return found or [Finding(CHECK, Severity.INFO, "no CUDA device (torch without CUDA, "
                                 "or no torch): GPU checks skipped")]
    evidence = (f"CUDA_VISIBLE_DEVICES={cvd if cvd is not None else '(unset)'}; "
                f"torch.cuda.device_count()={count}")
    if cvd and cvd.strip() not in ("", "-1") and not found:
        listed = len(_listed(cvd))
        if count < listed:
            found.append(Finding(
                CHECK, Severity.ERROR,
                f"CUDA_VISIBLE_DEVICES lists {listed} GPU(s) but torch sees {count}", evidence,
                "check the entries against `nvidia-smi -L`: CUDA hides every device from the "
                "first invalid one on"))
    job = inp.cluster()
    local_rank = None if job is None else job.local_rank
    if local_rank is not None and count > 0 and local_rank >= count:
        single = cvd is not None and len(_listed(cvd)) == 1
        fix = ("this rank already sees only its own GPU through CUDA_VISIBLE_DEVICES: use "
               "cuda:0 (torch.cuda.set_device(0)), not cuda:LOCAL_RANK" if single else
               f"start at most {count} rank(s) per node, or make more GPUs visible")
        found.append(Finding(
            CHECK, Severity.ERROR,
            f"LOCAL_RANK={local_rank} but this process sees {count} GPU(s): cuda:{local_rank} "
            "does not exist ('invalid device ordinal')", f"{evidence}; LOCAL_RANK={local_rank}",
            fix))
    ranks = inp.local_world_size()
    if local_rank is None and ranks is not None and count > 0 and ranks > count:
        found.append(Finding(
            CHECK, Severity.ERROR,
            f"{ranks} ranks per node but {count} GPU(s) visible: two ranks would share one GPU",
            f"{evidence}; ranks per node {ranks}",
            f"start at most {count} rank(s) per node (-n {count}); NCCL refuses two ranks "
            "on one GPU ('Duplicate GPU detected'), and cuda:LOCAL_RANK does not exist for "
            f"LOCAL_RANK >= {count}"))
    return found or [Finding(CHECK, Severity.INFO, f"{count} GPU(s) visible", evidence)]
