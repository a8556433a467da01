"""Run one node's share of a job: host or join the store, run attempts, report, exit code.

Why separate from the agent: the agent knows processes; this module knows the job -- the store
(hosted here on node 0, so it survives any worker), the rendezvous of several launchers, the
restart budget, the launcher's own signals, and which exit code and summary the user sees.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from types import FrameType
from typing import Any

from rankwise_autoload import ENV as CHECKS_ENV

from ..errors import DistError
from .agent import AgentConfig, AttemptResult, LocalAgent
from .companions import live_linger, say, start_live, start_watchdog, stop_watchdog
from .elastic import Round, await_round, close_rounds, join_round
from .foreign_alarm import ForeignAlarm
from .nodewatch import Detached, DetachedPeers, NodeWatch, as_death
from .rendezvous import RendezvousClosed, StorePeers
from .summary import (
    WorkerOutcome,
    blamed_elsewhere,
    cause_line,
    exit_status_text,
    format_summary,
    root_cause,
    shell_exit_code,
    straggler_lines,
)
from .torch_store import PLAIN_TORCH_LINE, TorchStoreHost
from .watchdog import MARKER_ENV, RUN_DIR_PREFIX

__all__ = ["JobOptions", "run_job"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class JobOptions:
    """What ``rankwise run`` was asked to do (see ``cli.py`` for the meaning of each)."""

    cmd: list[str]
    nproc: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    rdzv_id: str | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    tee: bool = False
    prefix: bool = False
    grace: float = 5.0
    timeout: float = 300.0
    token: str | None = None
    start_together: bool = True
    live: str | None = "127.0.0.1:0"  #: the live page's HOST:PORT (None: no page)
    role: str = "default"
    console_ranks: frozenset[int] | None = None
    #: ``stop`` (default: a failed rank ends the job) or ``continue`` (docs/recovery.md)
    on_failure: str = "stop"
    respawn: int = 0
    #: ``RANKWISE_TORCH_CHECKS`` of the workers (``rankwise_autoload``): plain torch groups
    #: on backend "rankwise" (``cpu``, ``on``) or as asked (``off``)
    checks: str = "cpu"


@contextmanager
def _forward_signals(agent: LocalAgent) -> Iterator[None]:
    """While workers run, the launcher's SIGINT/SIGTERM/SIGHUP go to the agent, not to us."""
    def handler(signum: int, frame: FrameType | None) -> None:
        agent.post_signal(signum)

    previous = {s: signal.signal(s, handler) for s in _FORWARDED}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _client(opts: JobOptions, port: int) -> Any:
    from ..store import TCPStore

    return TCPStore(opts.master_addr, port, is_master=False,
                    timeout=timedelta(seconds=opts.timeout), token=opts.token)


def _host_store(opts: JobOptions, alarm: ForeignAlarm,
                torch_store: TorchStoreHost) -> Any | None:
    """Start the store if this node hosts it; None if another node already does. Its
    torch clients (plain torch ranks) are served by torch's own store (``torch_store``)."""
    from ..store import TCPStoreServer

    server = TCPStoreServer(opts.master_addr, opts.master_port, token=opts.token,
                            on_foreign=alarm, on_torch_client=torch_store.take)
    try:
        server.start()
    except DistError:
        if opts.max_nodes == 1 or opts.node_rank == 0:
            raise
        return None  # the port is served by node 0's launcher: join as a client
    return server


class _ExitNotices:
    """Tells the job's store when a worker ends (``rankwise/<attempt>/exited/<rank>``), so
    ranks still forming the group raise at once naming it, instead of waiting out the
    rendezvous timeout for a rank that is gone. Best effort: a store problem here must
    not take the launcher down."""

    def __init__(self, opts: JobOptions, port: int, runner: Detached) -> None:
        #: under --on-failure=continue every ending is news (the survivors' shrink
        #: reads it), not only an attempt's first
        self._every = opts.on_failure == "continue"
        self._opts = opts
        self._port = port
        self._store: Any | None = None
        self._told: set[int] = set()
        self._runner = runner  # a silent store must not stall the teardown

    def __call__(self, attempt: int, outcome: WorkerOutcome) -> None:
        # only the first ending of an attempt: it is the cause; later ones are mostly ranks
        # that raised because of it, and naming those would blame the wrong rank
        if attempt in self._told and not self._every:
            return
        self._told.add(attempt)
        self._runner.submit(lambda: self._tell(attempt, outcome))

    def _tell(self, attempt: int, outcome: WorkerOutcome) -> None:
        how = (f"ended ({exit_status_text(outcome.returncode)}, pid {outcome.pid} on "
               f"{outcome.host})")
        try:
            if self._store is None:  # short: a lost notice must not delay the teardown
                self._store = _client(replace(self._opts, timeout=min(5.0, self._opts.timeout)),
                                      self._port)
            prefix = f"rankwise/{attempt}/exited"
            self._store.set(f"{prefix}/{outcome.rank}", how)
            self._store.add(f"{prefix}/count", 1)
        except DistError:
            pass

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def resolve_job_token(opts: JobOptions) -> tuple[str | None, str]:
    """The job's token and where it came from: ``--token-file``, ``RANKWISE_TOKEN_FILE``,
    ``RANKWISE_TOKEN`` or ``--token``; else, for a one-node job, a fresh random one (a
    job of several nodes cannot invent one: every node must hold the same)."""
    if opts.token:
        return opts.token, "given"
    if opts.max_nodes == 1:
        return secrets.token_hex(32), "generated"
    return None, "none"


def run_job(opts: JobOptions) -> int:
    """Run the job on this node; return the exit code the launcher should exit with."""
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    server: Any | None = None
    rounds: list[Round] = []  # this node's rendezvous rounds, the current one last
    runner = Detached("rankwise-store-notices")
    notices: _ExitNotices | None = None
    live: Any | None = None
    watchdog: subprocess.Popen[bytes] | None = None
    token, origin = resolve_job_token(opts)
    if origin == "none":
        say("rankwise run: warning: no shared token (RANKWISE_TOKEN_FILE, RANKWISE_TOKEN or "
             "--token-file); anyone who reaches the store port can read and change this "
             "job's rendezvous. Give every node the same token.")
    opts = replace(opts, token=token)
    alarm = ForeignAlarm(token, say)
    torch_store = TorchStoreHost(say, PLAIN_TORCH_LINE if opts.checks == "off" else None)
    try:
        try:
            hosts = opts.max_nodes == 1 or opts.node_rank in (None, 0)
            server = _host_store(opts, alarm, torch_store) if hosts else None
            port = server.port if server is not None else opts.master_port
            node_rank, nnodes = 0, 1
            if opts.max_nodes > 1:
                first = _first_round(opts, port)
                if first is None:
                    say("rankwise run: the job ended, or has no restart left, before a next "
                         "rendezvous round opened; this node was not needed")
                    return 0
                rounds.append(first)
                node_rank, nnodes = first.node_rank, first.nnodes
        except DistError as exc:
            say(f"rankwise run: {exc}")
            return 1
        base_env = dict(os.environ)
        marker = secrets.token_hex(12)
        base_env[MARKER_ENV] = marker  # every process of the job inherits it
        base_env[CHECKS_ENV] = opts.checks
        live = (start_live(opts.live, opts.master_addr, port, opts.token,
                           opts.nproc * nnodes if opts.max_nodes == 1 else 0)
                if server is not None else None)
        if opts.live:  # ranks publish for the page if node 0 serves one (a store key says)
            base_env["RANKWISE_LIVE"] = "1"
        alarm.marker = marker
        watchdog = start_watchdog(marker, run_dir)
        base_env.pop("RANKWISE_TOKEN_FILE", None)  # the token itself is what workers get
        if opts.token:
            # the environment, never the command line: /proc/<pid>/environ is readable by
            # this user (and root) only, while `ps` shows every process's arguments
            base_env["RANKWISE_TOKEN"] = opts.token
        config = AgentConfig(
            cmd=opts.cmd, nproc=opts.nproc, master_addr=opts.master_addr, master_port=port,
            run_id=opts.rdzv_id or secrets.token_hex(6), node_rank=node_rank, nnodes=nnodes,
            max_restarts=opts.max_restarts, grace=opts.grace, prefix=opts.prefix,
            log_dir=opts.log_dir, tee=opts.tee, base_env=base_env, run_dir=run_dir,
            start_together=opts.start_together, role=opts.role,
            console_ranks=opts.console_ranks,
            torch_store=torch_store if server is not None else None,
            keep_going=opts.on_failure == "continue", respawn=opts.respawn,
        )
        notices = _ExitNotices(opts, port, runner)
        agent = LocalAgent(config, DetachedPeers(rounds[0].peers, runner) if rounds else None,
                           notices)
        alarm.agent = agent
        if rounds:
            rounds[0].watch.start(agent.node_lost if config.keep_going else agent.abort)
        code = _run_attempts(agent, opts, rounds, port, runner)
        if rounds:
            last = rounds[-1]
            if server is not None:
                _release_waiting_nodes(opts, port, last.number)
            _finish(last.peers, last.watch, code, last.nnodes, server is not None, opts.timeout)
        return code
    finally:
        for rnd in rounds:
            rnd.watch.stop()
        runner.drain(2.0)
        stop_watchdog(watchdog)
        if notices is not None:
            notices.close()
        if live is not None:
            live.close(live_linger())
            for line in straggler_lines(live.collector.data()):  # the ranks' last windows
                say(line)
        torch_store.close()
        if server is not None:
            server.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _finish(peers: StorePeers, watch: NodeWatch | None, code: int, nnodes: int, hosting: bool,
            timeout: float) -> None:
    """Tell the other nodes this one is done; the store's host keeps it up for them, but
    after a failure only a few seconds (a lost node would never say it is done), and not at
    all when this node cannot reach the store."""
    if watch is not None and not watch.store_answers():
        return
    if watch is not None and (watch.lost or watch.suspect()):
        timeout = min(timeout, 2.0)
    elif code != 0:
        timeout = min(timeout, 5.0)
    peers.finish(nnodes, hosting=hosting, timeout=timeout)


def _clients(opts: JobOptions, port: int) -> Callable[[float | None], Any]:
    """Makes store clients whose calls time out after the given seconds (None: --timeout)."""
    def client(timeout: float | None) -> Any:
        return _client(opts if timeout is None else replace(opts, timeout=timeout), port)

    return client


def _join(opts: JobOptions, port: int, number: int, node_rank: int) -> Round:
    return join_round(number, _clients(opts, port), opts.nproc, opts.min_nodes, opts.max_nodes,
                      opts.rdzv_id or "none", node_rank, opts.timeout, say)


def _first_round(opts: JobOptions, port: int) -> Round | None:
    """This node's first round: the job's first rendezvous or, for a node that arrives after
    it closed (``--nnodes MIN:MAX`` with restarts left), the round of the next restart."""
    try:
        return _join(opts, port, 0, -1 if opts.node_rank is None else opts.node_rank)
    except RendezvousClosed as exc:
        if opts.min_nodes == opts.max_nodes or opts.max_restarts == 0:
            raise
        say(f"rankwise run: {exc}; waiting (up to --timeout {opts.timeout:g}s) to join at "
             f"the job's next restart")
    return await_round(_clients(opts, port), opts.nproc, opts.min_nodes, opts.max_nodes,
                       opts.rdzv_id or "none", opts.max_restarts, opts.timeout, say)


def _release_waiting_nodes(opts: JobOptions, port: int, current: int) -> None:
    """The job is over: a node waiting for a next round stops waiting (best effort)."""
    if opts.min_nodes == opts.max_nodes or opts.max_restarts == 0:
        return
    try:
        store = _client(replace(opts, timeout=2.0), port)
        try:
            close_rounds(store, current, opts.max_restarts)
        finally:
            store.close()
    except DistError:
        pass


def _may_restart(result: AttemptResult, opts: JobOptions, rnd: Round | None) -> bool:
    """Restart after this failed attempt? Not after a launcher abort (it would repeat)
    unless the abort was a lost node and MIN nodes may remain; never on a node that cannot
    reach the store (it is the one cut off)."""
    lost = rnd is not None and bool(rnd.watch.lost)
    if result.aborted and not (lost and opts.min_nodes < opts.max_nodes):
        return False
    return rnd is None or rnd.watch.store_answers()


def _too_few_left(result: AttemptResult, opts: JobOptions, rnd: Round | None,
                  attempt: int) -> str:
    """Why a restart cannot gather MIN nodes ("" when it may): the watch knows a node is
    gone and the others are too few, so a next round would only wait out --rdzv-timeout
    for it. The watch is asked only when one lost node breaks MIN and no rank here failed
    on its own (then the cause is here, not a lost node)."""
    if rnd is None or rnd.nnodes - 1 >= opts.min_nodes:
        return ""
    local = root_cause(result.outcomes)
    lost = rnd.watch.lost
    if not lost and (local is None or local.secondary) and not result.remote_failure \
            and rnd.peers.remote_outcome(attempt) is None:  # no node said why: one vanished?
        lost = rnd.watch.await_suspect()
    if not lost:
        return ""
    lost = as_death(rnd.watch, lost, result.outcomes)
    nnodes = str(opts.min_nodes) if opts.min_nodes == opts.max_nodes else \
        f"{opts.min_nodes}:{opts.max_nodes}"
    return (f"rankwise run: not restarting: {lost}. Without it {rnd.nnodes - 1} node(s) "
            f"remain and --nnodes {nnodes} needs {opts.min_nodes}; a restart would only wait "
            f"out --rdzv-timeout ({opts.timeout:g} s) for it")


def _next_round(agent: LocalAgent, opts: JobOptions, rounds: list[Round], port: int,
                runner: Detached) -> None:
    """Meet the surviving nodes again (``elastic.py``); the agent follows the new ranks."""
    old = rounds[-1]
    old.watch.stop()
    wish = 0 if old.node_rank == 0 else (-1 if opts.min_nodes < opts.max_nodes else old.node_rank)
    new = _join(opts, port, old.number + 1, wish)
    rounds.append(new)
    agent.config = replace(agent.config, node_rank=new.node_rank, nnodes=new.nnodes)
    agent.peers = DetachedPeers(new.peers, runner)
    new.watch.start(agent.abort)
    say(f"rankwise run: rendezvous round {new.number}: {new.nnodes} node(s), this is node "
         f"{new.node_rank}; {new.nnodes * opts.nproc} ranks")


def _run_attempts(agent: LocalAgent, opts: JobOptions, rounds: list[Round], port: int,
                  runner: Detached) -> int:
    first = rounds[0].number if rounds else 0  # a late node starts at its round's attempt
    with _forward_signals(agent):
        for attempt in range(first, opts.max_restarts + 1):
            result = agent.run_attempt(attempt)
            if result.interrupted_by is not None:
                name = signal.Signals(result.interrupted_by).name
                say(f"rankwise run: stopped by {name}; every rank was signalled and has exited")
                return 128 + result.interrupted_by
            if not result.failed:
                dropped = _dropped_ranks(opts, port, attempt)
                return _went_on(result, dropped) \
                    if result.lost or result.lost_nodes or dropped else 0
            rnd = rounds[-1] if rounds else None
            short = _too_few_left(result, opts, rnd, attempt) if attempt < opts.max_restarts else ""
            if short:
                say(short)
            elif attempt < opts.max_restarts and _may_restart(result, opts, rnd):
                cause = root_cause(result.outcomes)
                what = cause_line(cause) if cause else (result.remote_failure or result.aborted)
                say(f"rankwise run: attempt {attempt} failed ({what}); restarting the group "
                     f"(restart {attempt + 1} of {opts.max_restarts})")
                if rounds:
                    try:
                        _next_round(agent, opts, rounds, port, runner)
                    except DistError as exc:
                        say(f"rankwise run: could not meet the other nodes again: {exc}")
                        return 1
                continue
            return _report(result, attempt, opts, rnd.peers if rnd else None,
                           rnd.watch if rnd else None, plain_torch=_plain_torch(agent))
    return 1  # unreachable: the loop returns on its last attempt


def _plain_torch(agent: LocalAgent) -> bool:
    """Did plain torch ranks run (they reached torch's store: ``launch.torch_store``)?"""
    used = getattr(agent.config.torch_store, "used", None)
    return used is not None and bool(used.is_set())


#: ``rankwise run``'s exit status when the job finished under --on-failure=continue
#: but lost ranks on the way (the survivors, and any replacements, all exited 0)
LOST_RANKS_EXIT = 3


def _dropped_ranks(opts: JobOptions, port: int, attempt: int) -> list[str]:
    """Under --on-failure=continue: the ranks the workers' ``rankwise.shrink`` dropped
    (``api.recovery`` notes them in the store), also those of other nodes; best effort."""
    if opts.on_failure != "continue":
        return []
    try:
        store = _client(replace(opts, timeout=2.0), port)
        try:
            count = int(store.add(f"rankwise/{attempt}/lost/count", 0))
            return [store.get(f"rankwise/{attempt}/lost/{i}").decode("utf-8", "replace")
                    for i in range(count)]
        finally:
            store.close()
    except DistError:
        return []


def _went_on(result: AttemptResult, dropped: list[str]) -> int:
    """The end of a job that lost ranks and finished without them: say which were lost,
    and exit with ``LOST_RANKS_EXIT`` so a script can tell it from a clean run."""
    lost = [cause_line(o) for o in result.lost] + result.lost_nodes + dropped
    say("rankwise run: the job finished, but lost ranks on the way (--on-failure="
         "continue):\n  " + "\n  ".join(lost) + f"\nrankwise run: exit status "
         f"{LOST_RANKS_EXIT} (ranks were lost; the others finished)")
    return LOST_RANKS_EXIT


def _report(result: AttemptResult, attempt: int, opts: JobOptions, peers: StorePeers | None,
            watch: NodeWatch | None = None, plain_torch: bool = False) -> int:
    lost = (watch.lost or watch.suspect()) if watch is not None else ""
    reachable = peers is not None and (watch is None or watch.store_answers())
    remote = peers.remote_outcome(attempt) if not lost and reachable and peers is not None \
        else None
    local = root_cause(result.outcomes)
    # a plain torch rank that left no record cannot say whether it died of a peer
    unexplained = plain_torch and local is not None and local.error is None
    if watch is not None and not lost and remote is None and (
            local is None or local.secondary or unexplained):
        # our ranks died of a peer, and no node said why: one that vanished (its launcher
        # killed, its host gone) shows as silent within three beats -- name it, not a victim
        lost = watch.await_suspect()
    if lost and watch is not None:
        lost = as_death(watch, lost, result.outcomes)
    if lost:  # a lost node is the root cause of whatever failed after it
        say(format_summary(result.outcomes, restarts="", launcher_cause=lost))
        return 1
    cause = root_cause([o for o in (local, remote) if o is not None])
    remote_line = cause_line(remote) if remote is not None and cause is remote else ""
    if not remote_line and result.remote_failure and local is None:
        remote_line = result.remote_failure
    if not result.aborted:  # the first failure was a victim: name the rank it blamed
        remote_line = blamed_elsewhere(cause, result.outcomes) or remote_line
    # the launcher's own reason, unless a rank failed on its own before it
    launcher_line = result.aborted if local is None or local.secondary else ""
    restarts = f"{attempt} of {opts.max_restarts} restarts used" if opts.max_restarts else ""
    say(format_summary(result.outcomes, restarts=restarts, remote_cause=remote_line,
                        launcher_cause=launcher_line))
    if launcher_line:
        return 1
    if cause is None or cause.returncode is None:
        return 1
    return shell_exit_code(cause.returncode) or 1
