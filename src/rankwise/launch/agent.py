"""Start, watch and tear down the workers of one node.

Why it is built this way:

* **Own process group per worker** (``setpgid``), so a teardown signal reaches everything the
  worker started (data-loader processes, shells), and a terminal's Ctrl-C reaches the
  launcher only -- which forwards it, once, to every rank.
* **PR_SET_PDEATHSIG** in the child (Linux): if the launcher itself is SIGKILLed, the kernel
  kills its workers, so no rank is ever orphaned holding a port.
* **One reaper thread** (``launch.reaper``: every worker's pidfd in one selector, WUNTRACED
  looks to notice a SIGSTOPped rank) posts events to a queue; the main thread blocks on that
  queue with the next teardown deadline as timeout.
* **Released together**: each worker is held stopped until the node's last one is spawned
  (``launch.gate``), so none waits in init for a spawn loop slowed by the others.
* **News pipe per worker** (``RANKWISE_NODE_NEWS``): a node the node watch finds lost is
  written to every rank of this node at once (``core.heartbeat.LauncherNews`` raises it in
  every wait there), so the ranks do not wait for their own heartbeats, which under
  ``rankwise run`` default to 60 s (``LAUNCHED_HEARTBEAT_TIMEOUT``): the launcher's beats
  cover lost nodes, and a rank that holds the GIL for a while must not be reported.
* **Teardown after the first failure**: the other ranks were already told by the core (they
  raise ``PeerFailure``); they get ``grace`` seconds to finish their ``finally`` blocks, then
  SIGTERM (+SIGCONT so a stopped rank can act on it), then, ``grace`` seconds later, SIGKILL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from ..transport.keepalive import LAUNCHED_HEARTBEAT_TIMEOUT, NEWS_ENV
from .env import WorkerEnvSpec, worker_environment
from .gate import StartGate
from .output import StreamPump, console_stream
from .reaper import Reaper
from .summary import WorkerOutcome, exit_status_text, read_error_file

__all__ = ["AgentConfig", "AttemptResult", "LocalAgent", "RoundPeers", "TorchStoreSource",
           "set_parent_death_signal"]

_PR_SET_PDEATHSIG = 1


def _say(text: str) -> None:
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved in the parent so the forked child only has to call it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn: Callable[..., int] = libc.prctl
        return fn
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def set_parent_death_signal(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; else a no-op).

    ``parent_pid`` is the parent we expect: if it already died before the request took
    effect, exit now instead of running as an orphan.  0 skips the request.
    """
    if _PRCTL is None or parent_pid == 0:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _child_setup(launcher_pid: int) -> Callable[[], None]:
    def setup() -> None:
        os.setpgid(0, 0)  # its own process group (Popen's process_group= is Python 3.11+)
        set_parent_death_signal(launcher_pid)

    return setup


class TorchStoreSource(Protocol):
    """torch's own store behind rankwise's, for plain torch ranks (``launch.torch_store``)."""

    def begin_attempt(self, attempt: int) -> None:
        """A fresh torch store for ``attempt``."""


class RoundPeers(Protocol):
    """The other nodes of a multi-node job, as seen during one round (attempt)."""

    def announce_failure(self, outcome: WorkerOutcome) -> None:
        """Tell the other nodes that a rank here failed (first local failure only)."""

    def watch(self, restart_count: int, post: Callable[[str], None]) -> None:
        """Start watching for failures of other nodes; call ``post(description)`` on one."""

    def stop_watching(self) -> None:
        """Stop the watcher started by :meth:`watch`."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything one node's launcher needs to run its share of the job."""

    cmd: Sequence[str]
    nproc: int
    master_addr: str
    master_port: int
    run_id: str
    node_rank: int = 0
    nnodes: int = 1
    max_restarts: int = 0
    grace: float = 5.0
    prefix: bool = False
    log_dir: str | None = None
    tee: bool = True
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    run_dir: str = ""
    host: str = field(default_factory=socket.gethostname)
    #: spawn every worker stopped and release them together (``launch.gate``)
    start_together: bool = True
    torch_store: TorchStoreSource | None = None
    role: str = "default"  #: ``ROLE_NAME`` (torchrun's ``--role``)
    #: local ranks whose output reaches the console (torchrun's ``--local-ranks-filter``)
    console_ranks: frozenset[int] | None = None
    #: ``--on-failure=continue``: a worker that fails is reported, the others keep running
    #: (they recover in place: ``rankwise.shrink``, docs/recovery.md)
    keep_going: bool = False
    #: ``--respawn N``: with ``keep_going``, start a lost worker again as a joiner
    #: (``RANKWISE_JOIN=1``), at most N times on this node
    respawn: int = 0


@dataclass
class AttemptResult:
    """How one attempt ended: every worker's outcome, and a launcher signal if one came."""

    outcomes: list[WorkerOutcome]
    interrupted_by: int | None = None
    remote_failure: str = ""
    aborted: str = ""  #: why the launcher itself ended the attempt (``abort``), if it did
    #: workers that failed while the others kept going (``keep_going``), in order
    lost: list[WorkerOutcome] = field(default_factory=list)
    #: nodes the node watch found gone while this node kept going (``keep_going``)
    lost_nodes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        if self.remote_failure or self.aborted:
            return True
        if any(o.failed and all(o is not x for x in self.lost) for o in self.outcomes):
            return True
        # under --on-failure=continue a rank that fails is "lost", not a failure of the
        # job -- unless no rank of the node finished: then nobody went on
        return bool(self.lost) and all(o.failed for o in self.outcomes)


@dataclass
class _Worker:
    outcome: WorkerOutcome
    proc: subprocess.Popen[bytes]
    pumps: list[StreamPump]
    news: int = -1  #: the write end of its news pipe (-1: closed)

    def tell(self, line: bytes) -> None:
        """Write one line of news; dropped when the pipe is full or the rank gone."""
        if self.news >= 0:
            try:
                os.write(self.news, line)
            except OSError:
                pass

    def close_news(self) -> None:
        if self.news >= 0:
            os.close(self.news)
            self.news = -1


# Events posted to the agent's queue: (kind, local_rank or signal, wait status, time).
_Event = tuple[str, int, int, float]


class LocalAgent:
    """Runs ``config.nproc`` workers of one node, attempt by attempt."""

    def __init__(self, config: AgentConfig, peers: RoundPeers | None = None,
                 on_exit: Callable[[int, WorkerOutcome], None] | None = None) -> None:
        self.config = config
        self.peers = peers
        #: told ``(attempt, outcome)`` as each worker ends, so the ranks still in
        #: ``init_process_group`` learn of a rank that will never join (not a timeout later)
        self.on_exit = on_exit
        self._attempt = 0
        self._events: queue.SimpleQueue[_Event | tuple[str, str, int, float]] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._reaper = Reaper(lambda kind, rank, status, when:
                              self._events.put((kind, rank, status, when)))

    # -- signals --------------------------------------------------------------------------
    def post_signal(self, signum: int) -> None:
        """Called from the launcher's signal handler (SimpleQueue.put is reentrant)."""
        self._events.put(("signal", signum, 0, time.time()))

    # -- spawning -------------------------------------------------------------------------
    def abort(self, text: str) -> None:
        """End the current attempt as failed for ``text`` (any thread): the workers are
        torn down as for a failure on another node, and the summary names ``text`` as the
        root cause. Repeats while the attempt is going down are ignored."""
        self._events.put(("abort", text, 0, time.time()))

    def node_lost(self, text: str) -> None:
        """The node watch's news under ``keep_going``: reported, the workers go on."""
        self._events.put(("lost", text, 0, time.time()))

    def _open_log(self, attempt: int, local_rank: int, stream: str) -> BinaryIO | None:
        if not self.config.log_dir:
            return None
        path = os.path.join(self.config.log_dir, self.config.run_id, f"attempt_{attempt}",
                            str(local_rank), f"{stream}.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")

    def _spawn(self, local_rank: int, attempt: int, joining: bool = False) -> _Worker:
        cfg = self.config
        rank = cfg.node_rank * cfg.nproc + local_rank
        error_file = os.path.join(cfg.run_dir, f"attempt_{attempt}", f"rank_{rank}", "error.json")
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        spec = WorkerEnvSpec(
            rank=rank, local_rank=local_rank, world_size=cfg.nnodes * cfg.nproc,
            local_world_size=cfg.nproc, node_rank=cfg.node_rank, nnodes=cfg.nnodes,
            master_addr=cfg.master_addr, master_port=cfg.master_port, restart_count=attempt,
            max_restarts=cfg.max_restarts, run_id=cfg.run_id, error_file=error_file,
            role=cfg.role,
        )
        env = worker_environment(spec, cfg.base_env)
        if joining:  # the process joins the running world at its next grow()
            env["RANKWISE_JOIN"] = "1"
        if "RANKWISE_HEARTBEAT_TIMEOUT" not in cfg.base_env:  # the launchers watch nodes
            env["RANKWISE_HEARTBEAT_TIMEOUT"] = f"{LAUNCHED_HEARTBEAT_TIMEOUT:g}"
        news_r, news_w = os.pipe()
        os.set_blocking(news_w, False)
        # the inode too: a process that inherits the variable but not the pipe (a
        # subprocess started with close_fds) must not take another fd for it
        env[NEWS_ENV] = f"{news_r}:{os.fstat(news_r).st_ino}"
        logs = [self._open_log(attempt, local_rank, s) for s in ("stdout", "stderr")]
        # several workers sharing one console interleave mid-line (print() writes the
        # text and the newline separately): pipe them and pass on whole lines
        piped = cfg.prefix or cfg.log_dir is not None or cfg.nnodes * cfg.nproc > 1 \
            or cfg.console_ranks is not None
        try:
            proc = self._popen(env, piped, news_r)
        except BaseException:
            os.close(news_w)
            raise
        finally:
            os.close(news_r)
        pumps: list[StreamPump] = []
        if piped:
            to_console = (cfg.log_dir is None or cfg.tee) and (
                cfg.console_ranks is None or local_rank in cfg.console_ranks)
            prefix = f"[rank {rank}] ".encode() if cfg.prefix else b""
            for stream, log, is_err in ((proc.stdout, logs[0], False), (proc.stderr, logs[1], True)):
                assert stream is not None
                pumps.append(StreamPump(stream, prefix, console_stream(is_err) if to_console else None,
                                        log, name=f"rankwise-pump-{rank}"))
        outcome = WorkerOutcome(rank=rank, local_rank=local_rank, node_rank=cfg.node_rank,
                                pid=proc.pid, returncode=None, observed_at=0.0,
                                error_file=error_file, host=cfg.host)
        return _Worker(outcome, proc, pumps, news_w)

    def _popen(self, env: dict[str, str], piped: bool, news_r: int) -> subprocess.Popen[bytes]:
        cfg = self.config
        return subprocess.Popen(
            list(cfg.cmd),
            env=env,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.PIPE if piped else None,
            stdin=subprocess.DEVNULL,
            # Safe despite our threads: the hook only calls setpgid, a prctl resolved before
            # the fork and getppid; glibc's fork leaves malloc usable in the child.
            preexec_fn=_child_setup(os.getpid()),  # noqa: PLW1509
            pass_fds=(news_r,),
        )

    def _tell_ranks(self, verdict: str) -> None:
        """A lost node's verdict (``nodewatch.NodeVerdict``) to every rank here, at once."""
        rank = getattr(verdict, "rank", None)
        if rank is None:
            return  # not a lost node: the launcher's own reason ends the attempt as before
        cfg = self.config
        line = json.dumps({"message": str(verdict), "rank": rank, "node": cfg.node_rank,
                           "host": cfg.host}).encode() + b"\n"
        for w in self._workers:
            if w.outcome.returncode is None:
                w.tell(line)

    # -- signalling -----------------------------------------------------------------------
    def _signal_group(self, worker: _Worker, signum: int) -> None:
        try:
            os.killpg(worker.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _signal_running(self, signum: int, *, teardown: bool) -> None:
        for w in self._workers:
            if w.outcome.returncode is None:
                if teardown:
                    w.outcome.signalled_by_launcher = True
                self._signal_group(w, signum)
                if signum == signal.SIGTERM:
                    self._signal_group(w, signal.SIGCONT)

    # -- one attempt ----------------------------------------------------------------------
    def run_attempt(self, attempt: int) -> AttemptResult:
        """Spawn all workers, wait for them, tear down on the first failure; never leaves one."""
        cfg = self.config
        self._workers = []
        self._attempt = attempt
        result = AttemptResult(outcomes=[])
        try:
            if cfg.torch_store is not None:
                cfg.torch_store.begin_attempt(attempt)
            gate = StartGate(cfg.start_together and cfg.nproc > 1)
            try:
                for local_rank in range(cfg.nproc):
                    self._workers.append(self._spawn(local_rank, attempt))
                    gate.hold(self._workers[-1].proc.pid)
            finally:
                gate.release()
                for w in self._workers:  # watched from here: the gate's stops are not news
                    self._reaper.add(w.outcome.local_rank, w.proc.pid)
            if self.peers is not None:
                self.peers.watch(attempt, lambda text: self._events.put(("remote", text, 0, time.time())))
            self._monitor(result)
        finally:
            if self.peers is not None:
                self.peers.stop_watching()
            self._kill_leftovers()
        result.outcomes = [w.outcome for w in self._workers]
        return result

    def _monitor(self, result: AttemptResult) -> None:
        cfg = self.config
        running = {w.outcome.local_rank for w in self._workers}
        # Escalation ladder once the job is going down: (seconds to wait, signal to send after).
        ladder: list[tuple[float, int]] = []
        deadline: float | None = None
        going_down = False

        def start_teardown(already_sent: int | None) -> None:
            """Arm the ladder: grace, SIGTERM, grace, SIGKILL (shorter if a signal went out)."""
            nonlocal ladder, deadline, going_down
            going_down = True
            ladder = [(cfg.grace, signal.SIGKILL)]
            if already_sent != signal.SIGTERM:
                ladder.insert(0, (cfg.grace, signal.SIGTERM))
            deadline = time.monotonic() + ladder[0][0]

        while running:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                kind, what, status, when = self._events.get(timeout=timeout)
            except queue.Empty:
                _, signum = ladder.pop(0)
                self._signal_running(signum, teardown=True)
                # After SIGKILL there is nothing left to escalate to: the reapers report exits.
                deadline = time.monotonic() + ladder[0][0] if ladder else None
                continue
            if kind == "signal":
                assert isinstance(what, int)
                if result.interrupted_by is not None:  # second Ctrl-C: stop at once
                    self._signal_running(signal.SIGKILL, teardown=True)
                    continue
                result.interrupted_by = what
                self._signal_running(what, teardown=True)
                start_teardown(what)
            elif kind == "lost":
                assert isinstance(what, str)
                result.lost_nodes.append(what)
                self._tell_ranks(what)  # they recover in place: the sooner the better
                _say(f"rankwise run: {what}; --on-failure=continue: the ranks on this node "
                     "go on")
            elif kind in ("remote", "abort"):
                assert isinstance(what, str)
                if not going_down:
                    if kind == "remote":
                        result.remote_failure = what
                    else:
                        result.aborted = what
                        self._tell_ranks(what)
                    start_teardown(None)
            elif kind == "stop":
                assert isinstance(what, int)
                self._workers[what].outcome.stopped_at = when
            elif kind == "exit":
                assert isinstance(what, int)
                w = self._workers[what]
                self._record_exit(w, status, when)
                running.discard(what)
                if self.on_exit is not None and not going_down:
                    self.on_exit(self._attempt, w.outcome)
                if w.outcome.failed and not going_down and cfg.keep_going:
                    result.lost.append(w.outcome)
                    if self._replace(w, result):
                        running.add(what)
                elif w.outcome.failed and not going_down:
                    if self.peers is not None and not result.remote_failure:
                        self.peers.announce_failure(w.outcome)
                    start_teardown(None)

    def _replace(self, w: _Worker, result: AttemptResult) -> bool:
        """Under ``keep_going``: say that ``w`` was lost and, while ``respawn`` allows,
        start a joiner in its place (True when one was started)."""
        cfg = self.config
        lost = w.outcome
        again = sum(1 for o in result.lost if o.node_rank == cfg.node_rank) <= cfg.respawn
        _say(f"rankwise run: rank {lost.rank} {exit_status_text(lost.returncode)} (pid "
             f"{lost.pid}); --on-failure=continue: the other ranks go on"
             + ("; starting a replacement that joins at their next rankwise.grow()"
                if again else ""))
        if not again:
            return False
        for pump in w.pumps:
            pump.join(timeout=2.0)
        fresh = self._spawn(lost.local_rank, self._attempt, joining=True)
        self._workers[lost.local_rank] = fresh
        self._reaper.add(lost.local_rank, fresh.proc.pid)
        return True

    def _record_exit(self, w: _Worker, status: int, when: float) -> None:
        w.close_news()
        code = os.waitstatus_to_exitcode(status)
        w.proc.returncode = code
        w.outcome.returncode = code
        w.outcome.observed_at = when
        if code != 0:
            w.outcome.error = read_error_file(w.outcome.error_file)

    def _kill_leftovers(self) -> None:
        """SIGKILL every worker's process group (grandchildren too), reap, drain the pipes.

        Normally everything has exited already and this only catches grandchildren; after an
        exception in the monitor it is what guarantees that no worker outlives the launcher.
        """
        for w in self._workers:
            self._signal_group(w, signal.SIGKILL)
        missing = {w.outcome.local_rank for w in self._workers if w.outcome.returncode is None}
        while missing:
            try:
                kind, what, status, when = self._events.get(timeout=10.0)
            except queue.Empty:  # unkillable (D state): give up rather than hang the launcher
                break
            if kind == "exit" and isinstance(what, int) and what in missing:
                self._record_exit(self._workers[what], status, when)
                missing.discard(what)
        for w in self._workers:
            w.close_news()
            for pump in w.pumps:
                pump.join(timeout=2.0)
