"""Pick the root cause of a failed job and print one summary of it.

Why a separate module: when one rank dies, the others fail too (``PeerFailure`` from the core,
``Terminated`` from the launcher's SIGTERM).  Printing every failure in arrival order buries the
one that matters; this module decides which failure came first *on its own* and formats it
with its traceback, and lists the rest as consequences.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .error_files import PEER_LOST, from_torch_record
from .worker import one_line

__all__ = [
    "WorkerOutcome",
    "blamed_elsewhere",
    "exit_status_text",
    "format_summary",
    "read_error_file",
    "root_cause",
    "shell_exit_code",
    "straggler_lines",
]

#: Exception class names that are consequences of another rank's failure.
SECONDARY_EXCEPTIONS = frozenset({"PeerFailure", "Terminated", "KeyboardInterrupt", PEER_LOST})


@dataclass
class WorkerOutcome:
    """How one worker ended, as seen by its launcher (plus what it wrote to its error file).

    ``returncode`` follows ``subprocess``: negative means killed by that signal.
    ``observed_at`` is when the launcher reaped it; ``signalled_by_launcher`` is set when the
    launcher had already sent it a signal (its death is then not a cause).
    """

    rank: int
    local_rank: int
    node_rank: int
    pid: int
    returncode: int | None
    observed_at: float
    error_file: str = ""
    error: dict[str, Any] | None = None
    signalled_by_launcher: bool = False
    stopped_at: float | None = None
    host: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.returncode not in (0, None)

    @property
    def failed_at(self) -> float:
        """When it failed: the rank's own timestamp if it recorded one, else when reaped."""
        if self.error is not None:
            stamp = self.error.get("timestamp")
            if isinstance(stamp, (int, float)):
                return float(stamp)
        return self.observed_at

    @property
    def secondary(self) -> bool:
        """True if this failure is a consequence of another (peer failure, teardown)."""
        if self.signalled_by_launcher:
            return True
        if self.error is not None:
            mro = self.error.get("exc_mro") or [self.error.get("exc_type", "")]
            if any(name in SECONDARY_EXCEPTIONS for name in mro):
                return True
        return False

    @property
    def blames(self) -> int | None:
        """The rank this one's ``PeerFailure`` names as the one that failed, if any."""
        peer = self.error.get("peer") if self.error is not None else None
        return peer if isinstance(peer, int) and self.secondary else None

    def to_json(self) -> str:
        """Serialised for other nodes' launchers (multi-node summaries)."""
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WorkerOutcome:
        return cls(**json.loads(text))


def read_error_file(path: str) -> dict[str, Any] | None:
    """The record a worker wrote (``worker.py``, or torch's ``@record``: ``error_files``),
    or None if absent or unreadable."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return from_torch_record(data, path) or data


def shell_exit_code(returncode: int) -> int:
    """Exit code as a shell reports it: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def exit_status_text(returncode: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL (signal 9)``, ``exit code 143 (SIGTERM handler)``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {_signame(-returncode)} (signal {-returncode}, exit status {128 - returncode})"
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        return f"exit code {returncode} (after {_signame(returncode - 128)})"
    return f"exit code {returncode}"


def root_cause(outcomes: Iterable[WorkerOutcome]) -> WorkerOutcome | None:
    """The failure that came first on its own; if every failure is secondary, a rank that
    was stopped (SIGSTOP: frozen ranks blame the others when they wake), else the rank the
    ``PeerFailure``s blame when it is among ``outcomes``, else the first one."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return None
    primary = [o for o in failed if not o.secondary]
    stopped = [o for o in failed if o.stopped_at is not None]
    blamed = {o.blames for o in failed}
    return min(primary or stopped or [o for o in failed if o.rank in blamed] or failed,
               key=lambda o: (o.failed_at, o.rank))


def blamed_elsewhere(cause: WorkerOutcome | None, here: Iterable[WorkerOutcome]) -> str:
    """When ``cause`` only died of another rank (``PeerFailure``) that is not one of
    ``here``: a line naming that rank as the root cause, as ``cause`` reported it."""
    if cause is None or not cause.secondary or cause.blames is None or cause.error is None:
        return ""
    if any(o.rank == cause.blames for o in here):
        return ""
    return (f"rank {cause.blames}, as rank {cause.rank} (node {cause.node_rank}) reported it: "
            f"{_one_line_of(cause.error)}")


def _clock(stamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int(stamp % 1 * 1000):03d}"


def _indent(text: str, pad: str = "    ") -> str:
    return "".join(pad + line for line in text.rstrip().splitlines(keepends=True))


def _one_line_of(error: dict[str, Any]) -> str:
    return one_line(str(error.get("exc_type")), str(error.get("message")),
                    str(error.get("where") or ""))


def _describe(o: WorkerOutcome) -> str:
    text = exit_status_text(o.returncode)
    if o.error is not None:
        text += f", raised {_one_line_of(o.error)}"
    if o.stopped_at is not None:
        text += f", was stopped (SIGSTOP/SIGTSTP) at {_clock(o.stopped_at)}"
    if o.signalled_by_launcher:
        text += ", stopped by the launcher's teardown"
    return text


def format_summary(
    outcomes: Sequence[WorkerOutcome],
    *,
    title: str = "rankwise run: job failed",
    restarts: str = "",
    remote_cause: str = "",
    launcher_cause: str = "",
) -> str:
    """The one failure summary the launcher prints.

    ``remote_cause`` is a line about a failure on another node, when that node failed first;
    ``launcher_cause`` why the launcher itself ended the job (e.g. a torch-only script).
    """
    rule = "=" * 72
    lines = [rule, title + (f" ({restarts})" if restarts else "")]
    cause = root_cause(outcomes)
    if remote_cause:
        lines += ["-" * 72, f"Root cause (on another node): {remote_cause}"]
    if launcher_cause:
        lines += ["-" * 72, f"Root cause (the launcher ended the job): {launcher_cause}"]
    if cause is not None:
        first = not (remote_cause or launcher_cause)
        lines += ["-" * 72, "Root cause (first failure):" if first else "First failure here:"]
        lines.append(f"  rank       : {cause.rank} (local_rank {cause.local_rank}, node {cause.node_rank}"
                     + (f", host {cause.host}" if cause.host else "") + ")")
        lines.append(f"  time       : {_clock(cause.failed_at)}")
        lines.append(f"  status     : {exit_status_text(cause.returncode)}")
        lines.append(f"  pid        : {cause.pid}")
        if cause.stopped_at is not None:
            lines.append(f"  note       : was stopped (SIGSTOP) at {_clock(cause.stopped_at)}")
        if cause.error is not None:
            lines.append(f"  exception  : {cause.error.get('exc_type')}: {cause.error.get('message', '')}")
            lines.append("  traceback  :")
            lines.append(_indent(str(cause.error.get("traceback", ""))))
        else:
            lines.append(
                "  traceback  : (none recorded: the rank exited via sys.exit/os._exit, was killed "
                f"by a signal, or died in native code{'; error file ' + cause.error_file if cause.error_file else ''})"
            )
    others = sorted((o for o in outcomes if o is not cause), key=lambda o: o.rank)
    if others:
        lines += ["-" * 72, "Other ranks:"]
        lines += [f"  rank {o.rank}: {_describe(o)}" for o in others]
    lines.append(rule)
    return "\n".join(lines)


def cause_line(outcome: WorkerOutcome) -> str:
    """One line naming a failure, for other nodes' summaries."""
    text = f"rank {outcome.rank} (node {outcome.node_rank}) {exit_status_text(outcome.returncode)}"
    if outcome.error is not None:
        text += f": {_one_line_of(outcome.error)}"
    return text + f" at {_clock(outcome.failed_at)}"




def straggler_lines(page: dict[str, Any]) -> list[str]:
    """``straggler: rank 2 holds the others back 30.1 ms per step (...) in data.py:14 in
    __getitem__ ...``, one line per group with a straggler, from the live page's data at
    the end of the job (``live.collector``: the ranks' last snapshots); none when the
    ranks were balanced or the page was off."""
    return [f"straggler: {s['text']}" for s in page.get("stragglers") or []]
