"""Where am I in the job?  Read (and, for the launcher, write) the cluster environment.

``init_process_group(init_method="env://")`` calls :func:`detect_env` so that one script runs
unchanged under ``rankwise run``, ``torchrun``, ``srun`` and ``mpirun``.  The launcher side of
the same contract, :func:`worker_environment`, lives here too so the variable names are spelled
in one place only.

Detection order (the first source whose rank variable is present wins; within a source a
missing companion variable is an error, never a guess):

1. **torchrun / rankwise run**: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (default 0),
   ``MASTER_ADDR``, ``MASTER_PORT``.  ``source`` is ``"rankwise"`` when ``RANKWISE_LAUNCHED=1``
   else ``"torchrun"``.
2. **SLURM** (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (default 0).
   Master address: ``MASTER_ADDR`` if set, else the first host of ``SLURM_JOB_NODELIST``
   (``SLURM_NODELIST`` as fallback), e.g. ``node[07-09],gpu1`` -> ``node07``.  Master port:
   ``MASTER_PORT`` if set, else ``20000 + SLURM_JOB_ID % 10000`` so that every task of one job
   derives the same port without talking.
3. **Open MPI** (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK`` (default: the rank).
4. **PMI** (MPICH, Intel MPI, hydra): ``PMI_RANK``, ``PMI_SIZE``, local rank from
   ``MPI_LOCALRANKID`` or ``PMI_LOCAL_RANK`` (default: the rank).

For sources 3 and 4 the master comes from ``MASTER_ADDR``/``MASTER_PORT`` when set; otherwise
``master_addr``/``master_port`` are ``None`` and the caller picks its defaults (MPI launchers do
not export a host list).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .. import settings
from ..errors import RendezvousError

__all__ = [
    "ClusterEnv",
    "WorkerEnvSpec",
    "detect_env",
    "first_slurm_host",
    "require_env",
    "uses_agent_store",
    "worker_environment",
]


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job, as found in the environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str


def _int(environ: Mapping[str, str], name: str, source: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise RendezvousError(
            f"{source} environment is incomplete: {name} is not set (rank variables were found, "
            f"so the job was started by {source}; set {name} or unset the rank variable)"
        )
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"{name}={raw!r} is not an integer") from None


def _opt_int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"{name}={raw!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM compressed node list: ``a[07-09,12],b`` -> ``a07``."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip())
    token = first.group(0) if first else nodelist
    m = re.fullmatch(r"([^\[]*)\[([^\]\-,]+)[^\]]*\](.*)", token)
    if m is None:
        return token
    return m.group(1) + m.group(2) + m.group(3)


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    return environ.get("MASTER_ADDR") or None, _opt_int(environ, "MASTER_PORT", None)


def _torchrun(environ: Mapping[str, str]) -> ClusterEnv:
    source = "rankwise" if settings.flag("RANKWISE_LAUNCHED", environ) else "torchrun"
    addr, port = _master(environ)
    rank = _int(environ, "RANK", source)
    return ClusterEnv(
        rank=rank,
        world_size=_int(environ, "WORLD_SIZE", source),
        local_rank=_opt_int(environ, "LOCAL_RANK", 0) or 0,
        master_addr=addr,
        master_port=port,
        source=source,
    )


def _slurm(environ: Mapping[str, str]) -> ClusterEnv:
    addr, port = _master(environ)
    if addr is None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        addr = first_slurm_host(nodelist) if nodelist else None
    if port is None:
        job_id = _opt_int(environ, "SLURM_JOB_ID", None)
        port = None if job_id is None else 20000 + job_id % 10000
    return ClusterEnv(
        rank=_int(environ, "SLURM_PROCID", "slurm"),
        world_size=_int(environ, "SLURM_NTASKS", "slurm"),
        local_rank=_opt_int(environ, "SLURM_LOCALID", 0) or 0,
        master_addr=addr,
        master_port=port,
        source="slurm",
    )


def _mpi(environ: Mapping[str, str], rank_var: str, size_var: str, local_vars: tuple[str, ...],
         source: str) -> ClusterEnv:
    addr, port = _master(environ)
    rank = _int(environ, rank_var, source)
    local: int | None = None
    for name in local_vars:
        local = _opt_int(environ, name, None)
        if local is not None:
            break
    return ClusterEnv(
        rank=rank,
        world_size=_int(environ, size_var, source),
        local_rank=rank if local is None else local,
        master_addr=addr,
        master_port=port,
        source=source,
    )


def detect_env(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Find rank, world size, local rank and master in ``environ``; ``None`` if no source matches.

    See the module docstring for the order.  Raises ``RendezvousError`` when a source is
    recognised but incomplete or malformed, or when rank/world size are inconsistent.
    """
    if "RANK" in environ:
        env = _torchrun(environ)
    elif "SLURM_PROCID" in environ:
        env = _slurm(environ)
    elif "OMPI_COMM_WORLD_RANK" in environ:
        env = _mpi(environ, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   ("OMPI_COMM_WORLD_LOCAL_RANK",), "openmpi")
    elif "PMI_RANK" in environ:
        env = _mpi(environ, "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), "pmi")
    else:
        return None
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise RendezvousError(
            f"{env.source} environment says rank {env.rank} of world size {env.world_size}; "
            f"the rank must be in [0, world_size)"
        )
    return env


def uses_agent_store(environ: Mapping[str, str]) -> bool:
    """Whether a launcher already serves the store (then rank 0 connects as a client
    instead of hosting it): the flag :func:`worker_environment` sets."""
    yes = ("1", "true", "True", "yes")
    return (settings.flag("RANKWISE_AGENT_STORE", environ)
            or environ.get("TORCHELASTIC_USE_AGENT_STORE") in yes)


def require_env(environ: Mapping[str, str]) -> ClusterEnv:
    """Like :func:`detect_env` but raise a ``RendezvousError`` saying what to set."""
    env = detect_env(environ)
    if env is None:
        raise RendezvousError(
            "init_method='env://' found no rank in the environment: start the script with "
            "`rankwise run -n N script.py` (or torchrun/srun/mpirun), or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT yourself"
        )
    return env


@dataclass(frozen=True)
class WorkerEnvSpec:
    """What the launcher knows about one worker; rendered by :func:`worker_environment`."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    error_file: str
    role: str = "default"  #: ``ROLE_NAME`` (torchrun's ``--role``)


def worker_environment(spec: WorkerEnvSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of one worker: ``base`` plus exactly what torchrun sets, plus twins.

    ``TORCHELASTIC_USE_AGENT_STORE=True`` / ``RANKWISE_AGENT_STORE=1`` tell the core that the
    launcher already serves the store, so every rank (rank 0 included) connects as a client and
    a crash of rank 0 does not take the rendezvous down.  ``RANKWISE_TOKEN`` passes through
    from ``base`` untouched.  ``MASTER_PORT`` is rankwise's store, which also serves torch's
    own store protocol to plain torch ranks (``launch.torch_store``).
    ``OMP_NUM_THREADS=1`` and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` are defaults, as torchrun's.
    """
    env = dict(base)
    env.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        GROUP_RANK=str(spec.node_rank),
        GROUP_WORLD_SIZE=str(spec.nnodes),
        ROLE_RANK=str(spec.rank),
        ROLE_NAME=spec.role,
        ROLE_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        TORCHELASTIC_RESTART_COUNT=str(spec.restart_count),
        RANKWISE_RESTART_COUNT=str(spec.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
        TORCHELASTIC_RUN_ID=spec.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANKWISE_AGENT_STORE="1",
        RANKWISE_LAUNCHED="1",
        RANKWISE_ERROR_FILE=spec.error_file,
        TORCHELASTIC_ERROR_FILE=spec.error_file,
        PYTHONUNBUFFERED=base.get("PYTHONUNBUFFERED", "1"),
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if spec.local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
