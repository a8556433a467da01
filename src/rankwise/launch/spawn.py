"""``rankwise.spawn``: ``torch.multiprocessing.spawn`` semantics, plus a deadline.

Why reimplement: the seed programs start ranks with ``mp.spawn``/``mp.Process``; they need the
same calling convention (``fn(i, *args)``), and a failure must surface in the parent as an
exception that names the failing rank and carries its traceback -- as a ``PeerFailure``, so one
``except rankwise.PeerFailure`` covers launched and spawned jobs alike.

Waiting blocks in ``multiprocessing.connection.wait`` on the children's sentinels (the kernel
wakes us); when one child fails the others are terminated (SIGTERM, then SIGKILL after
``grace``) so nothing is left running.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from ..errors import DistTimeout, PeerFailure

__all__ = ["ProcessContext", "ProcessExitedException", "ProcessRaisedException", "spawn",
           "start_processes"]


class ProcessException(PeerFailure):
    """A spawned process failed; ``error_index`` is its rank, ``pid`` its process id."""

    def __init__(self, msg: str, error_index: int, error_pid: int, remote_traceback: str = "") -> None:
        super().__init__(msg, rank=error_index, remote_traceback=remote_traceback)
        self.error_index = error_index
        self.pid = error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.error_index, self.pid, self.remote_traceback)


class ProcessRaisedException(ProcessException):
    """The function raised in process ``error_index``; the message holds its traceback."""


class ProcessExitedException(ProcessException):
    """Process ``error_index`` exited non-zero or was killed without raising."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.error_index, self.pid, self.exit_code, self.signal_name)


def _wrap(fn: Callable[..., Any], i: int, args: tuple[Any, ...],
          error_conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    """Child entry point: run ``fn(i, *args)``; on an exception send its traceback home."""
    from .agent import set_parent_death_signal

    set_parent_death_signal(parent_pid)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent is stopping the group (torch does the same)
    except Exception:  # noqa: BLE001 -- any error must reach the parent with its traceback
        error_conn.send(traceback.format_exc())
        sys.exit(1)
    finally:
        error_conn.close()


class ProcessContext:
    """Handle on spawned processes; ``join(timeout)`` returns True once all exited cleanly."""

    def __init__(self, processes: list[BaseProcess],
                 error_conns: list[multiprocessing.connection.Connection],
                 deadline: float | None = None, grace: float = 3.0) -> None:
        self.processes = processes
        self.error_conns = error_conns
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        self._deadline = deadline
        self._grace = grace

    def pids(self) -> list[int]:
        return [p.pid or 0 for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the processes; raise on the first failure after stopping the others.

        Returns False if ``timeout`` passed with processes still running (call again), True
        when every process has exited with status 0.
        """
        if not self.sentinels:
            return True
        limit = None if timeout is None else time.monotonic() + timeout
        if self._deadline is not None:
            limit = self._deadline if limit is None else min(limit, self._deadline)
        wait_s = None if limit is None else max(0.0, limit - time.monotonic())
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=wait_s)
        failed: int | None = None
        for sentinel in ready:
            i = self.sentinels.pop(sentinel)  # type: ignore[arg-type]
            self.processes[i].join()
            if self.processes[i].exitcode != 0 and failed is None:
                failed = i
        if failed is None:
            if self._deadline is not None and time.monotonic() >= self._deadline and self.sentinels:
                running = sorted(self.sentinels.values())
                self._stop_all()
                raise DistTimeout(f"spawn timeout passed with processes {running} still running; "
                                  f"all processes were killed")
            return not self.sentinels
        self._stop_all()
        raise self._error_for(failed)

    def _error_for(self, i: int) -> ProcessException:
        proc = self.processes[i]
        pid = proc.pid or 0
        conn = self.error_conns[i]
        tb = ""
        if conn.poll():
            try:
                tb = conn.recv()
            except EOFError:  # the child closed its end without sending: it did not raise
                tb = ""
        if tb:
            return ProcessRaisedException(
                f"\n\n-- Process {i} terminated with the following error:\n{tb}", i, pid, tb)
        code = proc.exitcode or 0
        if code < 0:
            name = signal.Signals(-code).name
            return ProcessExitedException(f"process {i} terminated with signal {name}", i, pid,
                                          code, name)
        return ProcessExitedException(f"process {i} terminated with exit code {code}", i, pid, code)

    def _stop_all(self) -> None:
        """SIGTERM the running processes, SIGKILL what is left after ``grace``, reap all."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + self._grace
        for p in self.processes:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        self.sentinels.clear()


def start_processes(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1,
                    join: bool = True, daemon: bool = False, start_method: str = "spawn",
                    timeout: float | None = None) -> ProcessContext | None:
    """Start ``nprocs`` processes running ``fn(i, *args)``; see :func:`spawn`."""
    ctx = multiprocessing.get_context(start_method)
    deadline = None if timeout is None else time.monotonic() + timeout
    # Parent-death signal only from the main thread: PDEATHSIG fires when the *thread* that
    # forked exits, which would kill the children of a short-lived helper thread.
    parent = os.getpid() if threading.current_thread() is threading.main_thread() else 0
    processes: list[BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    for i in range(nprocs):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(  # type: ignore[attr-defined]
            target=_wrap, args=(fn, i, args, writer, parent), daemon=daemon)
        proc.start()
        writer.close()
        processes.append(proc)
        conns.append(reader)
    context = ProcessContext(processes, conns, deadline)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn",
          timeout: float | None = None) -> ProcessContext | None:
    """Run ``fn(i, *args)`` in ``nprocs`` new processes, ``i`` being 0..nprocs-1.

    Like ``torch.multiprocessing.spawn``: with ``join=True`` wait for all and raise
    ``ProcessRaisedException`` (the child's traceback in the message and in
    ``remote_traceback``) or ``ProcessExitedException`` (exit code / signal) for the first
    failing process, after terminating the rest; with ``join=False`` return the
    :class:`ProcessContext`.  ``timeout`` (seconds, rankwise extension) kills every process
    when it passes and raises ``DistTimeout``.
    """
    return start_processes(fn, args, nprocs, join, daemon, start_method, timeout)
