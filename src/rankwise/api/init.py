"""``init_process_group`` and friends: validate locally, reach the store (``api.stores``),
agree on who is who in a rendezvous that fails every rank at once on a conflict, then
open the mesh and choose each group's engine. Leaving: ``api.leaving``. The order of work
and why: docs/design.md, "init_process_group".
"""

from __future__ import annotations

import atexit
import os
import threading
from datetime import timedelta
from typing import Any

from .. import settings
from ..checks.groups import GroupEntry, agree_on_group
from ..core.communicator import Communicator
from ..core.group import ProcessGroup, seconds
from ..engines.backends import parse_backend
from ..engines.select import choose_engine, requested_engine
from ..engines.torch.nccl import nccl_missing, resolve_device
from ..errors import DistError, InvalidArgument, StoreError
from ..identity.callsite import capture
from ..shmem.host import host_identity
from ..store import PrefixStore
from ..store.base import Watcher
from ..transport.factory import open_transport, requested_transport
from ..transport.keepalive import heartbeat_timeout
from ..transport.mesh import address_of, local_address_for, open_listener
from ..wire.auth import resolve_token
from ..wire.device import tensor_path
from .init_done import wait_all_initialized
from .leaving import _install_hooks, _set_watcher, destroy_process_group
from .rendezvous import Joined, rendezvous
from .stores import _agent, _open_store, _resolve_store, _validate_rank_world
from .world import (
    GroupMember,
    World,
    WorldSpec,
    current,
    maybe_current,
    resolve_group,
    set_world,
)

__all__ = [
    # what rankwise.torch's store hand-over reuses (``api.stores``)
    "_open_store",
    "_resolve_store",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
]

DEFAULT_TIMEOUT = settings.number("RANKWISE_TIMEOUT")
#: the plain backend names init_process_group accepts on every machine (``"nccl"`` and
#: the ``"cpu:gloo,cuda:nccl"`` forms too where NCCL can run: ``engines.backends``)
BACKENDS = frozenset(("tcp", "gloo", "cpu:gloo", "cpu:tcp", "torch-gloo", "cpu:torch-gloo"))


def _check_backend(backend: str | None) -> str:
    """The backend name ``get_backend`` reports: what was asked, lower-cased, as torch does
    (``"gloo"``, ``"cpu:gloo"``). Which engine moves the data is the group's own business
    (``ProcessGroup.engine_name()``: ``"shm"``, ``"tcp"`` or ``"tiers"``)."""
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
    settings.check_all()  # every RANKWISE_* variable's value, before any I/O
    tensor_path()  # the test switch (wire.device), read before the backend's checks
    backend_name = _check_backend(backend)
    requested_engine(backend_name)  # a bad RANKWISE_ENGINE fails here, before any connection
    # this rank's GPU for NCCL groups, checked here: a wrong LOCAL_RANK costs no rendezvous
    device = resolve_device(device_id) if parse_backend(backend_name).nccl else None
    requested_transport()  # ... and so does a bad RANKWISE_TRANSPORT
    heartbeat_timeout()  # ... and a bad RANKWISE_HEARTBEAT_TIMEOUT
    timeout_s = seconds(timeout, DEFAULT_TIMEOUT)
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
    if store is not None and init_method is not None:
        raise InvalidArgument("pass either store= or init_method=, not both")
    secret = resolve_token(token)
    restart = settings.text("RANKWISE_RESTART_COUNT") or \
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
            # the token's proof goes with the rendezvous's first request: a round trip less
            store = _open_store(spec, timeout_s, secret, prove_with_first_request=True)
        stage = "rendezvous"
        base = PrefixStore(f"rankwise/{restart}", store)
        bind = settings.text("RANKWISE_BIND_ADDR") or local_address_for(master_addr)
        plan = WorldSpec(store, base, backend_name, timeout_s, bind, secret, device,
                         device_id, group_name)
        generation, launch_ranks, admitted = 0, tuple(range(world_size)), 0
        if settings.flag(JOIN_ENV):  # a late or restarted process: ``api.recovery``
            from ..recovery.agreement import await_ticket, request_admission

            ticket = await_ticket(base, request_admission(base, rank), timeout_s)
            generation, rank, world_size = ticket.generation, ticket.rank, ticket.world_size
            launch_ranks, admitted = ticket.launch_ranks, ticket.admitted
        scoped = generation_store(plan, generation)
        transport, joined = _connect(plan, scoped, rank, world_size)
    except DistError as exc:
        if not isinstance(exc, InvalidArgument):
            from ..doctor import explain_init_failure

            explain_init_failure(exc, hosting=stage == "store" and rank == 0 and not _agent(),
                                 token=secret)
        raise
    world = start_world(plan, scoped, rank, world_size, transport, generation, joined=joined)
    world.launch_ranks, world.admitted = launch_ranks, admitted
    world.joined = settings.flag(JOIN_ENV)


#: set (to "1") in a process that joins a running job (``rankwise.grow``) instead of
#: starting one; ``rankwise run --respawn`` sets it in the process it starts in place
#: of a lost rank
JOIN_ENV = "RANKWISE_JOIN"


def generation_store(plan: WorldSpec, generation: int) -> Any:
    """Where the ranks of membership ``generation`` meet: the job's namespace itself
    for the first, a fresh one under it for each later (no key of an older world is
    read as one of the new)."""
    return plan.base if generation == 0 else PrefixStore(f"gen/{generation}", plan.base)


def _connect(plan: WorldSpec, scoped: Any, rank: int, world_size: int,
             wait_s: float | None = None) -> tuple[Any, Joined]:
    """The rendezvous, then the transport to every peer (tcp: listen first and publish
    the address in the rendezvous, whose last rank to join hands every rank the whole
    address blob: one round of the job, not two); returns it and what the rendezvous
    brought (``Joined``)."""
    listener = open_listener(rank, world_size, plan.bind) \
        if world_size > 1 and requested_transport() == "tcp" else None
    try:
        limit = plan.timeout if wait_s is None else wait_s
        joined = rendezvous(scoped, rank, world_size, limit,
                             hosting=getattr(plan.store, "server", None) is not None,
                             address=None if listener is None else address_of(listener))
        return open_transport(rank, world_size, scoped, joined.job, plan.secret, plan.bind,
                              limit, listener, joined.blob), joined
    except BaseException:
        if listener is not None:
            listener.close()
        raise


def start_world(plan: WorldSpec, scoped: Any, rank: int, world_size: int, transport: Any,
                generation: int = 0, wait_s: float | None = None,
                joined: Joined | None = None) -> World:
    """Put this process's world together on a connected ``transport`` and make it the
    current one; returns when every rank got this far (``wait_all_initialized``).
    ``joined``: what the rendezvous brought (hosts, whether a rank hosts the store)."""
    # diagnosis builds on api: imported here, not at module level
    from ..diagnosis.dump import install_signal_dumps
    from ..diagnosis.recorders import attach_recorders

    comm = Communicator(rank, world_size, transport)
    attach_recorders(comm)
    default = ProcessGroup(comm, 0, list(range(world_size)), plan.timeout, plan.backend,
                           plan.group_name or "the default group (WORLD)")
    world = World(comm, default, plan.store, scoped, plan.backend, plan.timeout,
                  device_id=plan.device_id, spec=plan, generation=generation,
                  launch_ranks=tuple(range(world_size)))
    world.register(default)
    comm.site_lookup = world.site_lookup
    _set_watcher(plan.store, _store_watcher(comm))
    set_world(world)
    _install_hooks()
    if settings.flag("RANKWISE_LIVE"):  # `rankwise run` serves the live page
        _start_live(comm)
    if comm.dumper is not None:
        install_signal_dumps(lambda: getattr(maybe_current(), "comm", None))
    default.engine = choose_engine(default, scoped, plan.timeout,
                                   None if joined is None else joined.hosts, plan.device)
    # no rank leaves a peer still in init (nor the store's host a peer still reading it)
    wait_all_initialized(scoped, comm, plan.timeout if wait_s is None else wait_s,
                         hosting=getattr(plan.store, "server", None) is not None,
                         held=joined is None or joined.hosted)
    return world


def _start_live(comm: Communicator) -> None:
    """Start this rank's live-page publisher beside init, not in it: its own store
    connection and first snapshot are 5 round trips, seconds on a slow link, and the page
    is best effort, never the job's. A process ending meanwhile waits (bounded) for it and
    publishes its last state, as one that started it in line would."""
    from ..live.publisher import current_publisher, start_publisher

    starter = threading.Thread(target=start_publisher, args=(comm,), name="rankwise-live-start",
                               daemon=True)
    starter.start()

    def at_exit() -> None:
        if starter.is_alive():  # its own last snapshot at exit was not registered in time
            starter.join(_LIVE_START_WAIT)
            publisher = current_publisher()
            if publisher is not None:
                publisher.final()
    atexit.register(at_exit)


_LIVE_START_WAIT = 5.0  #: seconds an ending process waits for its publisher to start


def connect_world(plan: WorldSpec, generation: int, rank: int, world_size: int,
                  wait_s: float) -> World:
    """A new world of ``world_size`` ranks in the same store, this process as ``rank``:
    what ``shrink`` and ``grow`` build, with init's own rendezvous and engines (their
    waits bounded by ``wait_s``; the new world's calls by init's timeout)."""
    scoped = generation_store(plan, generation)
    transport, joined = _connect(plan, scoped, rank, world_size, wait_s)
    return start_world(plan, scoped, rank, world_size, transport, generation, wait_s, joined)


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
