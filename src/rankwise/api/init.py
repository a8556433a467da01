"""``init_process_group`` and friends: from environment to a connected, checked job.

Order of work, and why:
1. Validate every argument locally (before any I/O): backend, rank, world size, init
   method, timeout.
2. Reach the rendezvous store (rank 0 hosts it unless a launcher already does).
3. Agree on the world size and on who is who in the store: a second claim on a rank or
   a disagreeing world size is published under an ``error`` key so that *every* waiting
   rank fails at once with the same explanation, instead of timing out.
4. Wait (bounded) for all ranks; on timeout name the missing ones.
5. Open the authenticated mesh of data connections, start the I/O thread.
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlparse

from .._version import __version__
from ..checks.groups import GroupEntry, agree_on_group
from ..core.communicator import Communicator
from ..core.group import ProcessGroup, seconds
from ..core.work import stop_worker
from ..diagnosis.dump import install_signal_dumps
from ..diagnosis.recorders import attach_recorders
from ..engines.backends import parse_backend
from ..engines.nccl import nccl_missing, resolve_device
from ..engines.select import choose_engine, host_identity, requested_engine
from ..errors import (
    DistError,
    DistTimeout,
    InvalidArgument,
    PeerFailure,
    RendezvousError,
    StoreError,
)
from ..identity.callsite import capture
from ..launch.env import detect_env, uses_agent_store
from ..store import FileStore, PrefixStore, TCPStore
from ..store.base import Watcher
from ..store.seen import HOLD_LIMIT, count_seen_and_hold
from ..transport.factory import open_transport, requested_transport
from ..transport.mesh import exited_peers, local_address_for
from ..wire.auth import resolve_token
from ..wire.device import tensor_path
from ..wire.frames import VERSION as WIRE_VERSION
from .world import GroupMember, World, current, maybe_current, resolve_group, set_world

__all__ = [
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
]

DEFAULT_TIMEOUT = float(os.environ.get("RANKWISE_TIMEOUT", "1800"))
#: the plain backend names init_process_group accepts on every machine (``"nccl"`` and
#: the ``"cpu:gloo,cuda:nccl"`` forms too where NCCL can run: ``engines.backends``)
BACKENDS = frozenset(("tcp", "gloo", "cpu:gloo", "cpu:tcp", "torch-gloo", "cpu:torch-gloo"))


def _check_backend(backend: str | None) -> str:
    """The backend name ``get_backend`` reports: what was asked, lower-cased, as torch does
    (``"gloo"``, ``"cpu:gloo"``). Which engine moves the data is the group's own business
    (``ProcessGroup.engine_name()``: ``"shm"`` or ``"tcp"``)."""
    if backend is None:
        return "tcp"
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string, got {backend!r}")
    spec = parse_backend(backend.lower())
    if spec.nccl:
        why = nccl_missing()
        if why is not None:
            raise InvalidArgument(
                f"backend {backend!r} needs a CUDA GPU with NCCL, but {why}; on CPU use "
                "backend 'gloo' (rankwise's own engine) or 'torch-gloo' (torch's gloo moves "
                "the data)")
    return spec.name


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


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    token: str | bytes | None = None,
) -> None:
    """Join the job: same signature and meaning as ``torch.distributed``'s.

    ``backend``: ``"tcp"`` (``"gloo"`` is an alias so torch scripts only change their
    import), or ``"torch-gloo"``: torch's gloo moves the data, rankwise's checks stay on;
    ``"nccl"``/``"cpu:gloo,cuda:nccl"``: CUDA tensors on NCCL (on ``device_id``, else
    ``LOCAL_RANK``, else the current device), everything else on the CPU engine. CUDA
    tensors on a CPU backend are staged through host memory, as on torch's gloo.
    ``init_method``: ``"env://"`` (default), ``"tcp://host:port"`` or ``"file:///path"``.
    ``token`` (or ``RANKWISE_TOKEN``): shared secret every connection must prove.
    """
    if maybe_current() is not None:
        raise InvalidArgument("init_process_group was already called in this process; call "
                              "destroy_process_group() first to re-initialize")
    tensor_path()  # the test switch (wire.device), read before the backend's checks
    backend_name = _check_backend(backend)
    requested_engine(backend_name)  # a bad RANKWISE_ENGINE fails here, before any connection
    # this rank's GPU for NCCL groups, checked here: a wrong LOCAL_RANK costs no rendezvous
    device = resolve_device(device_id) if parse_backend(backend_name).nccl else None
    requested_transport()  # ... and so does a bad RANKWISE_TRANSPORT
    timeout_s = seconds(timeout, DEFAULT_TIMEOUT)
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
    if store is not None and init_method is not None:
        raise InvalidArgument("pass either store= or init_method=, not both")
    secret = resolve_token(token)
    restart = os.environ.get("RANKWISE_RESTART_COUNT") or \
        os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"

    # arguments and environment first: their errors are raised before any I/O, and are
    # not init failures for the doctor to explain by probing ports
    if store is None:
        spec = _resolve_store(init_method or "env://", rank, world_size)
        rank, world_size, master_addr = spec.rank, spec.world_size, spec.host
    else:
        _validate_rank_world(rank, world_size)
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    stage = "store"  # what init was doing when it failed: the doctor's hint for the port
    try:
        if store is None:
            store = _open_store(spec, timeout_s, secret)
        stage = "rendezvous"
        scoped = PrefixStore(f"rankwise/{restart}", store)
        job = _rendezvous(scoped, rank, world_size, timeout_s,
                          hosting=getattr(store, "server", None) is not None)
        bind = os.environ.get("RANKWISE_BIND_ADDR") or local_address_for(master_addr)
        transport = open_transport(rank, world_size, scoped, job, secret, bind, timeout_s)
    except DistError as exc:
        if not isinstance(exc, InvalidArgument):
            from ..doctor import explain_init_failure

            explain_init_failure(exc, hosting=stage == "store" and rank == 0 and not _agent(),
                                 token=secret)
        raise
    comm = Communicator(rank, world_size, transport)
    attach_recorders(comm)
    default = ProcessGroup(comm, 0, list(range(world_size)), timeout_s, backend_name,
                           group_name or "the default group (WORLD)")
    world = World(comm, default, store, scoped, backend_name, timeout_s, device_id=device_id)
    world.register(default)
    comm.site_lookup = world.site_lookup
    _set_watcher(store, _store_watcher(comm))
    set_world(world)
    _install_hooks()
    if comm.dumper is not None:
        install_signal_dumps(lambda: getattr(maybe_current(), "comm", None))
    default.engine = choose_engine(default, scoped, timeout_s, device=device)


def _set_watcher(store: Any, watcher: Watcher | None) -> None:
    """``Store.set_watcher``, where the job's store has it (a store passed in by the
    user may be of another kind: it is then not watched)."""
    set_watcher = getattr(store, "set_watcher", None)
    if callable(set_watcher):
        set_watcher(watcher)


def _store_watcher(comm: Communicator) -> Watcher:
    """What a rank blocked in a store round hears (see ``store.base``): the job's failure
    (a peer's exception, a mismatch) as soon as it is known; and when the store itself
    fails (its host exited), the failure of a peer that explains it, if one comes within
    a second, rather than "the store went away"."""
    router = comm.router

    def watch(err: StoreError | None) -> None:
        failure = router.failure
        if failure is None and err is not None:
            failure = router.wait_for_any_cause(list(range(comm.world_size)), 1.0)
        if failure is not None:
            # not ``from err``: the lost store is a consequence of the peer's failure, and
            # a chain would print it first, as "the direct cause" (it stays the context)
            raise comm.as_of_now(failure) from None
    return watch


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


def _open_store(spec: _StoreSpec, timeout_s: float, secret: bytes | None) -> Any:
    """The job's store as ``spec`` names it (rank 0 hosts a TCP one unless a launcher
    already serves it)."""
    if spec.scheme == "file":
        return FileStore(spec.path, spec.world_size)
    if spec.scheme == "torchrun":
        return _open_torchrun_store(spec, timeout_s)
    return TCPStore(spec.host, spec.port, world_size=None,
                    is_master=(spec.rank == 0 and not _agent()),
                    timeout=timedelta(seconds=timeout_s), token=secret)


def _under_torchrun_agent() -> bool:
    """Whether MASTER_PORT is torch's own store, served by torchrun's agent
    (``TORCHELASTIC_USE_AGENT_STORE``): it speaks torch's store protocol, not rankwise's.
    (``rankwise run`` sets torchrun's variables too, for torch code, but serves a
    rankwise store.)"""
    return ("TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANKWISE_LAUNCHED") != "1"
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


def _rendezvous(store: Any, rank: int, world_size: int, timeout_s: float,
                hosting: bool = False) -> bytes:
    """Agree on world size and identities; return the job's id (shared by all ranks)."""
    def failed(exc: RendezvousError, late_ones: bool = True) -> RendezvousError:
        # Count this process as having seen the failure. The process hosting the store
        # keeps it up (bounded) until every process has seen it too, or they would meet a
        # dead store ("connection refused", "went away") instead of this explanation.
        # ``late_ones``: also wait for processes still starting up (an error found early,
        # like a duplicate rank); after a join timeout, only for those that arrived.
        count_seen_and_hold(
            store, "error/seen",
            lambda: max(int(store.add("arrived", 0)), world_size if late_ones else 0),
            hosting, min(HOLD_LIMIT, timeout_s))
        return exc

    def fail(message: str, late_ones: bool = True) -> RendezvousError:
        try:
            if not late_ones:
                store.set("error/no-late-ones", "1")  # before the error: readers see both
            store.set("error", message)
            store.set("joined/all", "error")  # wakes every rank waiting for the others
        except DistError:
            pass
        return failed(RendezvousError(message), late_ones)

    def failed_elsewhere() -> RendezvousError:
        message = store.get("error").decode()
        return failed(RendezvousError(message), not store.check(["error/no-late-ones"]))

    store.add("arrived", 1)
    agreed = store.compare_set("world_size", "", str(world_size)).decode()
    if agreed != str(world_size):
        raise fail(f"world sizes disagree: rank {rank} was started with world_size="
                   f"{world_size} but a rank that joined earlier said {agreed}. Start every "
                   "process with the same WORLD_SIZE")
    me = f"{socket.gethostname()} pid {os.getpid()}"
    build = _build()
    agreed = store.compare_set("build", "", build).decode()
    if agreed != build:
        # who runs the other one: the first rank that agreed names itself (if it got there)
        who = store.get("build/by").decode() if store.check(["build/by"]) else \
            "a rank that joined earlier"
        raise fail(f"rank {rank} ({me}) runs {build}, but {who} runs {agreed}. Every "
                   "process of a job must run the same rankwise (install the same version "
                   "on every node, in every environment the job uses)")
    store.compare_set("build/by", "", f"rank {rank} ({me})")
    if int(store.add(f"claim/{rank}", 1)) > 1:
        other = store.get(f"joined/{rank}").decode() if store.check([f"joined/{rank}"]) else "?"
        raise fail(f"two processes claim rank {rank}: {other} and {me}. Give every process "
                   "its own RANK (0..world_size-1)")
    store.set(f"joined/{rank}", me)
    job_hex = store.compare_set("job", "", secrets.token_hex(8)).decode()
    # one key, set by the last rank to join: waiting costs the store O(1) per rank, and
    # only rank 0 looks for ended ranks often (it wakes the others through this key; the
    # others look every 10 s in case rank 0 itself is gone): the polling of a slow start
    # costs O(1) requests per second for the job, not O(N)
    if int(store.add("joined/count", 1)) == world_size:
        store.compare_set("joined/all", "", "ok")
    keys = ["joined/all"]
    poll = 0.5 if rank == 0 else 10.0
    deadline = time.monotonic() + timeout_s
    auth_note = ""
    while True:
        if store.check(["error"]):
            raise failed_elsewhere()
        remaining = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(0.05, min(poll, remaining))))
            break
        except DistTimeout:
            gone = exited_peers(store, [r for r in range(world_size) if r != rank])
            if gone:
                peer, how = min(gone.items())
                raise fail(f"rank {rank}: rank {peer} {how} before the group was formed "
                           "(it never finished init_process_group); the job cannot go on "
                           "without it") from None
            note = _auth_note(store)
            if note and not auth_note:
                sys.stderr.write(f"rankwise: rank {rank} is waiting for ranks to join, and the "
                                 f"rendezvous store reports: {note}\n")
            auth_note = note or auth_note
            if remaining <= 0:
                missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
                joined = world_size - len(missing)
                hint = (f" Meanwhile the store reports: {auth_note} — was a missing rank "
                        "started with a different RANKWISE_TOKEN?") if auth_note else ""
                raise fail(
                    f"rank {rank}: only {joined} of {world_size} ranks joined within "
                    f"{timeout_s:.0f}s; missing ranks {missing}. Check that every process "
                    f"was started, with WORLD_SIZE={world_size} and its own RANK, and that it "
                    f"reaches MASTER_ADDR:MASTER_PORT.{hint}", late_ones=False) from None
    if store.check(["error"]):
        raise failed_elsewhere()
    return bytes.fromhex(job_hex)


def _build() -> str:
    """What must be equal on every rank: the version, and the wire protocol's. Why in the
    rendezvous: ranks of different versions may word frames, flags or algorithms
    differently, which surfaces (if at all) as a protocol error at some later call;
    here it is one sentence on every rank before any connection is made."""
    return f"rankwise {__version__} (wire protocol {WIRE_VERSION})"


def _auth_note(store: Any) -> str:
    probe = getattr(store, "auth_failures", None)
    try:
        return str(probe()) if callable(probe) else ""
    except DistError:
        return ""


# --- leaving ------------------------------------------------------------------------------

def destroy_process_group(group: Any = None) -> None:
    """Leave the job (no group) or forget one group. Peers still waiting on this rank
    are told where it left, instead of waiting for a timeout."""
    world = current()
    if group is not None and group is not GroupMember.WORLD and group is not world.default_group:
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        gone = world.groups.pop(getattr(group, "id", -1), None)
        if gone is not None:
            gone.engine.close()
        return
    site = capture()
    _leave(world, f"called destroy_process_group at {site.short}", linger=True)


#: how long the process hosting the store waits, when leaving, for the others to leave
LEAVE_LINGER = 10.0


def _leave(world: World, where: str, linger: bool = False) -> None:
    """Say goodbye and release everything. ``linger``: an explicit, healthy
    destroy_process_group, after which the store's host waits for the others to leave
    (at exit after an exception nobody waits: the others may be stuck or dead)."""

    clean = linger and world.comm.router.failure is None
    for group in list(world.groups.values()):
        group.engine.settle()  # ahead of the goodbye: a peer stops reading after it
    world.comm.goodbye(where)
    stop_worker()
    for group in list(world.groups.values()):
        group.engine.close()
    if clean:
        _let_the_others_leave(world)
    _set_watcher(world.store, None)  # the job is over: a plain store from here on
    close = getattr(world.store, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001, S110 - leaving must not fail on a dead store
            pass
    set_world(None)


def _let_the_others_leave(world: World) -> None:
    """Count this rank out; the process hosting the store then waits (bounded) until
    every rank has counted out, so no rank still reading the store (an engine agreement
    of a group it is finishing, its own leaving) finds it gone: "the store went away" on
    a peer of a job that ended well. Skipped after a failure: the others may be dead."""
    try:
        if int(world.rendezvous.add("left", 1)) >= world.comm.world_size:
            world.rendezvous.set("all-left", "1")
        if getattr(world.store, "server", None) is not None:
            world.rendezvous.wait(["all-left"], timedelta(seconds=LEAVE_LINGER))
    except DistError:
        pass  # a peer that never leaves, or a store already gone: leave anyway


def is_initialized() -> bool:
    return maybe_current() is not None


def is_available() -> bool:
    return True


def get_backend(group: Any = None) -> str:

    g = resolve_group(group)
    if g is None:
        raise InvalidArgument("this rank is not a member of that group")
    return g.backend


def get_rank(group: Any = None) -> int:

    g = resolve_group(group)
    return -1 if g is None else g.group_rank


def get_world_size(group: Any = None) -> int:

    g = resolve_group(group)
    return -1 if g is None else g.size()


def new_group(ranks: list[int] | None = None, timeout: timedelta | float | None = None,
              backend: str | None = None, pg_options: Any = None,
              use_local_synchronization: bool = False, group_desc: str | None = None) -> Any:
    """Create a group; like torch, every rank of the job must call it, in the same order."""
    world = current()
    backend_name = world.backend if backend is None else _check_backend(backend)
    requested_engine(backend_name)  # before the group round: no torch, no round
    if parse_backend(backend_name).nccl:
        resolve_device(world.device_id)  # ... and no GPU that does not exist
    members = list(range(world.comm.world_size)) if ranks is None else list(ranks)
    for r in members:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world.comm.world_size:
            raise InvalidArgument(f"new_group: rank {r!r} is not in 0..{world.comm.world_size - 1}")
    if len(set(members)) != len(members):
        raise InvalidArgument(f"new_group: ranks {members} contain duplicates")
    if not members:
        raise InvalidArgument("new_group: ranks must not be empty")
    members = sorted(members)
    limit = seconds(timeout, world.timeout)
    gid = world.next_group_id(members)
    comm = world.comm
    # every rank, member or not, says which group it creates now: out of order is an
    # error here, on every rank (see checks.groups); the hosts serve the engine choice
    entries = agree_on_group(world.rendezvous, world.group_counter,
                             GroupEntry(tuple(members), capture(), host_identity()),
                             comm.rank, comm.world_size, limit,
                             hosting=getattr(world.store, "server", None) is not None)
    if comm.rank not in members:
        return GroupMember.NON_GROUP_MEMBER
    return make_group(world, gid, members, limit, group_desc or f"group {members}",
                      backend_name, hosts=[entries[r].host for r in members])


def make_group(world: World, gid: int, members: list[int], timeout_s: float, desc: str,
               backend_name: str | None = None,
               hosts: list[str] | None = None) -> ProcessGroup:
    """Build, register and give an engine to the group ``gid`` of the sorted global ranks
    ``members``; only members call it. Shared by ``new_group`` and the torch backend
    (torch asks only the members, and names the group itself). ``hosts``: the members'
    host identities when a round already gathered them (else the engine choice asks)."""
    group = ProcessGroup(world.comm, gid, members, timeout_s,
                         world.backend if backend_name is None else backend_name, desc)
    world.register(group)
    nccl = parse_backend(group.backend).nccl
    group.engine = choose_engine(group, world.rendezvous, group.timeout, hosts=hosts,
                                 device=resolve_device(world.device_id) if nccl else None)
    return group


# --- process hooks ----------------------------------------------------------------------

_hooks_installed = False
_previous_excepthook = sys.excepthook


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    world = maybe_current()
    if world is not None and not world.comm.closed:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        if isinstance(exc, PeerFailure) and exc.rank is not None:
            info = world.comm.relay_of(exc)  # secondary: name the rank that failed first
        else:
            info = {"kind": "exception", "rank": world.comm.rank,
                    "message": f"{exc_type.__name__}: {exc}"[:4000],
                    "traceback": text[-40000:], "last": world.comm.last_call}
        try:
            world.comm.broadcast_abort(info)
        except Exception:  # noqa: BLE001, S110 - the original error matters more
            pass
        if world.comm.dumper is not None:
            world.comm.dumper.write(f"uncaught {exc_type.__name__}: {exc}")
    _previous_excepthook(exc_type, exc, tb)


def _at_exit() -> None:

    world = maybe_current()
    if world is not None and not world.comm.closed:
        _leave(world, "exited without calling destroy_process_group")
    stop_worker()  # never leave the async thread running into interpreter shutdown


def _install_hooks() -> None:
    global _hooks_installed, _previous_excepthook
    if _hooks_installed:
        return
    _hooks_installed = True
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
