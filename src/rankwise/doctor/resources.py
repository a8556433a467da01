"""Machine resources: /dev/shm size, open-file limit, CPUs per rank against DataLoader
workers and OpenMP threads."""

from __future__ import annotations

from .findings import Finding, Severity
from .inputs import Inputs

__all__ = ["SHM_MIN_BYTES", "check_cpus", "check_open_files", "check_shm"]

MiB = 1 << 20
#: below this, DataLoader workers and NCCL run out of shared memory (Docker's default is 64 MiB;
#: NVIDIA's containers documentation asks for --shm-size=1g)
SHM_MIN_BYTES = 512 * MiB
#: open files a DataLoader with workers can take (one descriptor per tensor in flight)
NOFILE_FOR_WORKERS = 4096


def check_shm(inp: Inputs) -> list[Finding]:
    shm = inp.shm
    fix = ("give the container more: `docker run --shm-size=1g` (or --ipc=host); Kubernetes: "
           "mount an emptyDir with medium: Memory on /dev/shm")
    if shm is None:
        return [Finding("shm", Severity.WARNING, "/dev/shm is missing", "statvfs('/dev/shm') "
                        "failed", "DataLoader workers and NCCL need it; " + fix)]
    evidence = f"/dev/shm: {shm.total // MiB} MiB, {shm.free // MiB} MiB free"
    if shm.total < SHM_MIN_BYTES:
        return [Finding("shm", Severity.WARNING, f"/dev/shm is only {shm.total // MiB} MiB",
                        evidence, "DataLoader workers die with 'Bus error' / 'insufficient "
                        "shared memory' and NCCL fails to extend /dev/shm/nccl-* segments; "
                        + fix)]
    if shm.free < min(SHM_MIN_BYTES // 4, shm.total // 10):
        return [Finding("shm", Severity.WARNING, "/dev/shm is nearly full", evidence,
                        "remove what dead jobs left there (`ls -la /dev/shm`), or enlarge it")]
    return [Finding("shm", Severity.INFO, evidence)]


def check_open_files(inp: Inputs) -> list[Finding]:
    if inp.nofile is None:
        return []
    soft, hard = inp.nofile
    world = inp.world_size() or inp.local_world_size() or 1
    # a rank: one socket per peer + the store + Python's own; the store's host: one per rank
    need = 2 * world + 64
    evidence = f"ulimit -n: soft {soft}, hard {hard}; world size {world}"
    raise_to = f"ulimit -n {hard if hard != -1 else 65536}"
    if soft != -1 and soft < need:
        return [Finding("files", Severity.ERROR,
                        f"the open-file limit {soft} is too low for {world} ranks",
                        evidence, f"{raise_to} before launching (about {need} are needed); "
                        "if the hard limit is lower, raise it in /etc/security/limits.conf or "
                        "with `docker run --ulimit nofile=65536:65536`")]
    if inp.num_workers and soft != -1 and soft < NOFILE_FOR_WORKERS:
        return [Finding("files", Severity.WARNING,
                        f"the open-file limit {soft} is low for DataLoader workers",
                        f"{evidence}; num_workers {inp.num_workers}",
                        f"{raise_to}: workers pass every tensor as a file descriptor ('Too many "
                        "open files', 'received 0 items of ancdata'), or call torch.multi"
                        "processing.set_sharing_strategy('file_system')")]
    return [Finding("files", Severity.INFO, evidence)]


def check_cpus(inp: Inputs) -> list[Finding]:
    if inp.cpus is None:
        return []
    cpus, ranks = inp.cpus.usable, inp.local_world_size() or 1
    usable = max(1, int(cpus))
    evidence = f"{inp.cpus.evidence}; {ranks} rank(s) on this node"
    found: list[Finding] = []
    if ranks > usable:
        found.append(Finding(
            "cpus", Severity.WARNING, f"{ranks} ranks share {cpus:g} usable CPU(s)", evidence,
            f"start at most {usable} rank(s) per node, or give the job more CPUs: ranks "
            "waiting for a CPU slow every collective"))
    workers = inp.num_workers
    if workers:
        per_rank = max(0, usable // ranks - 1)
        if ranks * (1 + workers) > usable:
            found.append(Finding(
                "cpus", Severity.WARNING,
                f"num_workers={workers} on {ranks} rank(s): {ranks * (1 + workers)} busy "
                f"processes for {cpus:g} CPU(s)", f"{evidence}; num_workers {workers}",
                f"use num_workers={per_rank} (CPUs per rank minus the rank itself)"
                + ("" if per_rank else ", i.e. load in the main process") +
                "; more workers than cores only add switching and memory"))
    omp = inp.env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and ranks * int(omp) > usable:
        found.append(Finding(
            "cpus", Severity.WARNING,
            f"OMP_NUM_THREADS={omp} on {ranks} rank(s): {ranks * int(omp)} threads for "
            f"{cpus:g} CPU(s)", evidence,
            f"set OMP_NUM_THREADS={max(1, usable // ranks)}"))
    return found or [Finding("cpus", Severity.INFO, evidence)]
