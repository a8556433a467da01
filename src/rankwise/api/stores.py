"""Where the job's store is (``init_method`` and the environment, read before any I/O),
and opening it: rankwise's own TCPStore or FileStore, or torchrun's agent store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from .. import settings
from ..errors import (
    InvalidArgument,
    RendezvousError,
    StoreError,
)
from ..launch.env import detect_env, uses_agent_store
from ..store import FileStore, TCPStore


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={raw!r} is not an integer") from None


def _from_cluster_env(rank: int, world_size: int, addr: str | None, port: int | None
                      ) -> tuple[int, int, str | None, int | None]:
    """Fill what the caller did not give from the cluster environment: torchrun/rankwise
    (RANK, WORLD_SIZE), SLURM, Open MPI or PMI. One parser for those variables
    (``launch.env.detect_env``), shared with the launcher that writes them."""
    if rank != -1 and world_size != -1 and addr is not None and port is not None:
        return rank, world_size, addr, port

    env = detect_env(os.environ)
    if env is None:
        return rank, world_size, addr, port
    return (env.rank if rank == -1 else rank, env.world_size if world_size == -1 else world_size,
            addr or env.master_addr, port if port is not None else env.master_port)


def _validate_rank_world(rank: int, world_size: int) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{name} must be an int, got {value!r}")
    if rank == -1:  # first: without RANK, the environment's WORLD_SIZE is not read either
        raise InvalidArgument("rank is unknown: pass rank= or set RANK")
    if world_size == -1:
        raise InvalidArgument("world_size is unknown: pass world_size= or set WORLD_SIZE")
    if world_size < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise InvalidArgument(f"rank {rank} is out of range for world_size {world_size} "
                              f"(valid ranks: 0..{world_size - 1})")


@dataclass(frozen=True)
class _StoreSpec:
    """Where the store is and who this rank is, read from ``init_method`` and the
    environment before any I/O (so a bad argument is an error of its own, not a failed
    connection the doctor would go probing for)."""

    #: "env"/"tcp" (a TCPStore at host:port), "file" (a FileStore at path) or "torchrun"
    #: (torch's TCPStore, served by torchrun's agent at host:port)
    scheme: str
    rank: int
    world_size: int
    host: str
    port: int = 0
    path: str = ""


def _resolve_store(init_method: str, rank: int, world_size: int) -> _StoreSpec:
    url = urlparse(init_method)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if "rank" in query and rank == -1:
        rank = _query_int(query, "rank", init_method)
    if "world_size" in query and world_size == -1:
        world_size = _query_int(query, "world_size", init_method)
    if url.scheme == "env":
        scheme = "torchrun" if _under_torchrun_agent() else "env"
        rank, world_size, addr, port = _from_cluster_env(
            rank, world_size, os.environ.get("MASTER_ADDR") or None, _env_int("MASTER_PORT"))
        _validate_rank_world(rank, world_size)
        if not addr:
            raise InvalidArgument("init_method='env://' needs MASTER_ADDR (the host of rank 0 "
                                  "or of the launcher's store), e.g. MASTER_ADDR=127.0.0.1")
        if port is None:
            raise InvalidArgument("init_method='env://' needs MASTER_PORT, e.g. MASTER_PORT=29500")
        return _StoreSpec(scheme, rank, world_size, addr, port)
    if url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise InvalidArgument(f"init_method {init_method!r} must look like tcp://host:port")
        _validate_rank_world(rank, world_size)
        return _StoreSpec("tcp", rank, world_size, url.hostname, url.port)
    if url.scheme == "file":
        _validate_rank_world(rank, world_size)
        if not url.path:
            raise InvalidArgument(f"init_method {init_method!r} must look like file:///path")
        return _StoreSpec("file", rank, world_size, "127.0.0.1", path=url.path)
    raise InvalidArgument(f"unsupported init_method {init_method!r}; use env://, "
                          "tcp://host:port or file:///path")


def _open_store(spec: _StoreSpec, timeout_s: float, secret: bytes | None,
                prove_with_first_request: bool = False) -> Any:
    """The job's store as ``spec`` names it (rank 0 hosts a TCP one unless a launcher
    already serves it). ``prove_with_first_request``: for a caller whose first request
    follows at once (``TCPStore``'s option of that name)."""
    if spec.scheme == "file":
        return FileStore(spec.path, spec.world_size)
    if spec.scheme == "torchrun":
        return _open_torchrun_store(spec, timeout_s)
    return TCPStore(spec.host, spec.port, world_size=None,
                    is_master=(spec.rank == 0 and not _agent()),
                    timeout=timedelta(seconds=timeout_s), token=secret,
                    prove_with_first_request=prove_with_first_request)


def _under_torchrun_agent() -> bool:
    """Whether MASTER_PORT is torch's own store, served by torchrun's agent
    (``TORCHELASTIC_USE_AGENT_STORE``): it speaks torch's store protocol, not rankwise's.
    (``rankwise run`` sets torchrun's variables too, for torch code, but serves a
    rankwise store.)"""
    return ("TORCHELASTIC_RUN_ID" in os.environ and not settings.flag("RANKWISE_LAUNCHED")
            and _agent())


def _open_torchrun_store(spec: _StoreSpec, timeout_s: float) -> Any:
    """torchrun's store, as a rankwise store: rankwise's rendezvous runs on it through a
    view (as for the ``"rankwise"`` torch backend), so a rankwise script runs under
    torchrun unchanged, with no second port. The store is torch's, without rankwise's
    token: the job's own connections still prove ``RANKWISE_TOKEN`` when one is set."""
    where = f"torchrun's store at {spec.host}:{spec.port}"
    try:
        import torch.distributed as tdist

        from ..store.torch_views import RankwiseStoreView
    except ImportError as exc:
        raise RendezvousError(
            "this rankwise script was started by torchrun, whose MASTER_PORT is torch's own "
            f"store, but torch cannot be imported here to reach it ({exc}): start it with "
            "`rankwise run` instead (same options, e.g. `rankwise run --nproc-per-node 2 "
            "script.py`)") from exc
    timeout = timedelta(seconds=timeout_s)
    try:
        inner = tdist.TCPStore(  # type: ignore[attr-defined]  # (exported at run time)
            spec.host, spec.port, is_master=False, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        raise StoreError(f"could not reach {where}: {exc}") from exc
    return RankwiseStoreView(inner, timeout)


def _query_int(query: dict[str, str], name: str, init_method: str) -> int:
    try:
        return int(query[name])
    except ValueError:
        raise InvalidArgument(f"init_method {init_method!r}: {name}={query[name]!r} is not "
                              "an integer") from None


def _agent() -> bool:
    """Whether a launcher serves the store (``launch.env.uses_agent_store``)."""
    return uses_agent_store(os.environ)
