"""Everything the checks read, in one value that tests can build by hand.

:func:`gather` fills it from this machine; a test passes a fake environment mapping, a
fake interface list, fake probes. The job-shape helpers (local world size, node count,
local rank) live here so every check reads them the same way.
"""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import RendezvousError
from ..launch.env import ClusterEnv, detect_env
from .probes import GpuProbes, NetProbes, read_text, usable_cpus_from_affinity

__all__ = ["Cpus", "Inputs", "ShmSpace", "cgroup_cpu_limit", "gather"]


@dataclass(frozen=True)
class ShmSpace:
    """``/dev/shm``: size and free bytes."""

    total: int
    free: int


@dataclass(frozen=True)
class Cpus:
    """CPUs this process may run on, and how that number was found."""

    usable: float
    evidence: str


@dataclass
class Inputs:
    """What the checks look at. ``None`` means "unknown here": a check then stays quiet."""

    env: Mapping[str, str]
    hostname: str = "localhost"
    interfaces: Sequence[str] = ()
    shm: ShmSpace | None = None
    nofile: tuple[int, int] | None = None
    cpus: Cpus | None = None
    #: ranks per node (``-n``); else read from the environment
    nproc: int | None = None
    #: nodes of the job (``--nnodes``); else read from the environment
    nnodes_option: int | None = None
    num_workers: int | None = None
    #: True/False: this process will (not) host the store; None: decide from MASTER_ADDR
    hosting: bool | None = None
    net: NetProbes = field(default_factory=NetProbes)
    gpus: GpuProbes = field(default_factory=GpuProbes)
    token_file: str | None = None

    # --- the job's shape, read one way for every check ------------------------------------

    def cluster(self) -> ClusterEnv | None:
        """Rank, world size, local rank and master from the environment (``None``: this
        process is not a rank of a job; a malformed environment is the env check's
        finding, so here it counts as none)."""
        try:
            return detect_env(self.env)
        except RendezvousError:
            return None

    def in_job(self) -> bool:
        return self.cluster() is not None

    def local_world_size(self) -> int | None:
        if self.nproc is not None:
            return self.nproc
        for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            value = _int(self.env.get(name))
            if value is not None and value > 0:
                return value
        return None

    def nnodes(self) -> int | None:
        if self.nnodes_option is not None:
            return self.nnodes_option
        for name in ("GROUP_WORLD_SIZE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "NNODES"):
            value = _int(self.env.get(name))
            if value is not None and value > 0:
                return value
        world, local = _int(self.env.get("WORLD_SIZE")), self.local_world_size()
        if world and local:
            return max(1, -(-world // local))
        return None

    def multi_node(self) -> bool:
        return (self.nnodes() or 1) > 1

    def world_size(self) -> int | None:
        job = self.cluster()
        if job is not None:
            return job.world_size
        local = self.local_world_size()
        return None if local is None else local * (self.nnodes() or 1)

    def master(self) -> tuple[str | None, int | None]:
        job = self.cluster()
        if job is not None:
            return job.master_addr, job.master_port
        return self.env.get("MASTER_ADDR") or None, _int(self.env.get("MASTER_PORT"))


def _int(raw: str | None) -> int | None:
    try:
        return None if raw is None or raw == "" else int(raw)
    except ValueError:
        return None


def cgroup_cpu_limit(read: Callable[[str], str | None] = read_text) -> tuple[float, str] | None:
    """The container's CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1 CFS quota), with
    the file it came from; ``None`` without a quota."""
    try:
        text = read("/sys/fs/cgroup/cpu.max")
        if text:
            parts = text.split()
            if len(parts) == 2 and parts[0] != "max":
                return int(parts[0]) / int(parts[1]), f"cgroup cpu.max '{text.strip()}'"
            return None
        quota = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        period = read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if quota and period and int(quota) > 0:
            return (int(quota) / int(period),
                    f"cgroup cpu.cfs_quota_us {quota.strip()} / cpu.cfs_period_us {period.strip()}")
    except (ValueError, ZeroDivisionError):
        pass
    return None


def usable_cpus(affinity: int, quota: tuple[float, str] | None) -> Cpus:
    """CPUs a job can use here: the affinity mask, capped by a container quota."""
    if quota is not None and quota[0] < affinity:
        return Cpus(quota[0], f"{affinity} CPUs in the affinity mask, capped by {quota[1]}")
    return Cpus(float(affinity), f"{affinity} CPUs in this process's affinity mask")


def _shm_space(path: str = "/dev/shm") -> ShmSpace | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return ShmSpace(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def gather(env: Mapping[str, str] | None = None, *, nproc: int | None = None,
           nnodes: int | None = None, num_workers: int | None = None,
           hosting: bool | None = None, token_file: str | None = None,
           net: NetProbes | None = None, gpus: GpuProbes | None = None) -> Inputs:
    """The inputs of this machine (cheap: no network traffic happens here)."""
    return Inputs(
        env=dict(os.environ if env is None else env),
        hostname=socket.gethostname(),
        interfaces=_interfaces(),
        shm=_shm_space(),
        nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        cpus=usable_cpus(usable_cpus_from_affinity(), cgroup_cpu_limit()),
        nproc=nproc,
        nnodes_option=nnodes,
        num_workers=num_workers,
        hosting=hosting,
        net=net or NetProbes(),
        gpus=gpus or GpuProbes(),
        token_file=token_file,
    )
