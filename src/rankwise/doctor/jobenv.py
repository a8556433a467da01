"""The rank variables themselves: the same parser as ``init_process_group`` (so the
doctor and init never disagree), and LOCAL_RANK against LOCAL_WORLD_SIZE."""

from __future__ import annotations

from ..errors import RendezvousError
from ..launch.env import detect_env
from .findings import Finding, Severity
from .inputs import Inputs

__all__ = ["check_job_env"]


def check_job_env(inp: Inputs) -> list[Finding]:
    try:
        job = detect_env(inp.env)
    except RendezvousError as exc:
        return [Finding("job", Severity.ERROR, "the job's rank variables are inconsistent",
                        str(exc), "set RANK, WORLD_SIZE and LOCAL_RANK together (or start with "
                        "`rankwise run`, which sets them all)")]
    if job is None:
        return [Finding("job", Severity.INFO, "not inside a job (no RANK/SLURM/MPI rank "
                        "variables): checking this machine for a job to come")]
    local = inp.local_world_size()
    if local is not None and job.local_rank >= local:
        return [Finding("job", Severity.ERROR,
                        f"LOCAL_RANK={job.local_rank} is not below LOCAL_WORLD_SIZE={local}",
                        f"source {job.source}", "give the ranks of a node local ranks "
                        "0..LOCAL_WORLD_SIZE-1")]
    return [Finding("job", Severity.INFO, f"rank {job.rank} of {job.world_size} "
                    f"(local rank {job.local_rank}) from {job.source}")]
