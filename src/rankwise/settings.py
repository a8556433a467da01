"""Every ``RANKWISE_*`` environment variable: declared once, read and validated here.

Why one module: a variable read in one file and documented in another drifts (seven were
documented nowhere), and a typo in a value must be an error naming the variable and what
it takes, not a silent default. Each reader still reads when it did before (at import, or
per call), through :func:`flag`, :func:`choice`, :func:`integer`, :func:`number` or
:func:`text`; ``init_process_group`` checks every set variable first (:func:`check_all`),
so a bad value fails before any I/O. README's table is :func:`table`'s output (a test
compares them). This module sits below every package: it imports only ``errors``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import InvalidArgument

__all__ = ["VARIABLES", "Var", "check_all", "choice", "choices", "flag", "integer", "number",
           "table", "text"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    """One variable. ``kind``: ``flag`` (1/0), ``choice`` (one of ``choices``), ``int``,
    ``number`` (a float), ``text`` (taken as written: a path, an address, a secret).
    ``default``: the value when unset or empty, as a user would write it ("" for none,
    ``None`` where the reader computes it; ``doc`` says how). ``low``/``strict``: the
    lower bound of a number (``strict``: the bound itself is refused). ``who``: ``user``,
    ``launcher`` (``rankwise run`` sets it in every worker) or ``tests``."""

    name: str
    kind: str
    default: str | None
    doc: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    strict: bool = False
    who: str = "user"

    def accepts(self) -> str:
        """What the variable takes, for its error and README's table."""
        if self.kind == "flag":
            return "1/0, true/false, yes/no, on/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind in ("int", "number"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.low is None:
                return what
            bound = f"{self.low:g}"
            return f"{what} {'>' if self.strict else '>='} {bound}"
        return "any text"

    def parse(self, raw: str) -> bool | str | int | float:
        """``raw`` (non-empty) as this variable's value; a bad one is ``InvalidArgument``."""
        value = raw.strip().lower() if self.kind in ("flag", "choice") else raw.strip()
        if self.kind == "text":
            return raw
        if self.kind == "flag" and value in _ON + _OFF:
            return value in _ON
        if self.kind == "choice" and value in self.choices:
            return value
        if self.kind in ("int", "number"):
            try:
                num: float = int(value) if self.kind == "int" else float(value)
            except ValueError:
                num = math.nan
            if not math.isnan(num) and (self.low is None or num > self.low or
                                        (num == self.low and not self.strict)):
                return num
        raise InvalidArgument(f"{self.name}={raw!r} is not {self.accepts()} ({self.doc})")


def _v(name: str, kind: str, default: str | None, doc: str, *choices: str,
       low: float | None = None, strict: bool = False, who: str = "user") -> Var:
    return Var(f"RANKWISE_{name}", kind, default, doc, choices, low, strict, who)


_KIB = str(256 << 10)
#: in the order README's table lists them: choosing, security, time, diagnosis, tuning,
#: then what the launcher and the tests set
VARIABLES: dict[str, Var] = {v.name: v for v in (
    _v("ENGINE", "choice", "auto", "which engine moves a CPU group's data (auto: shm on "
       "one host, tiers across hosts with several ranks each, else tcp)",
       "auto", "tcp", "shm", "tiers", "torch-gloo"),
    _v("TRANSPORT", "choice", "tcp", "the frames' transport: TCP to every peer, shared "
       "memory on one host, or auto (shm within a host, tcp across)", "tcp", "shm", "auto"),
    _v("CONNECT", "choice", "auto", "tcp connections: a full mesh at init (eager), each "
       "opened at first use (lazy); auto: lazy from 32 ranks", "auto", "eager", "lazy"),
    _v("CHECK", "choice", "async", "how engines whose data rankwise does not own check that "
       "ranks make the same call (the ring check)", "async", "sync", "off"),
    _v("NCCL_P2P", "choice", "", "CUDA send/recv: 1 on NCCL, 0 through host memory "
       "(unset: NCCL on an NCCL group)", "0", "1"),
    _v("ALLREDUCE", "choice", "auto", "force one all_reduce algorithm (benchmarking)",
       "auto", "doubling", "tree", "ring", "halving"),
    _v("TOKEN", "text", "", "the job's shared secret: every connection proves it"),
    _v("TOKEN_FILE", "text", "", "a file holding the token (read when RANKWISE_TOKEN is "
       "unset; keeps it out of the environment)"),
    _v("ALLOW_PICKLE", "flag", "0", "let object collectives unpickle what peers send (a "
       "trusted job only; else plain data only)"),
    _v("BIND_ADDR", "text", "", "the address this rank listens on (default: the one that "
       "reaches MASTER_ADDR)"),
    _v("TIMEOUT", "number", "1800", "seconds a call or init waits when no timeout= is "
       "given", low=0, strict=True),
    _v("HEARTBEAT_TIMEOUT", "number", "15", "seconds of silence after which a peer is "
       "reported lost; 0 turns heartbeats off", low=0),
    _v("NODE_TIMEOUT", "number", "3.5", "seconds of silence after which rankwise run's "
       "launchers report another node lost (0: off; off too when RANKWISE_HEARTBEAT_TIMEOUT "
       "is 0)", low=0),
    _v("HANDSHAKE_TIMEOUT", "number", "10", "seconds a new connection's handshake may "
       "take", low=0, strict=True),
    _v("WARN_AFTER", "number", "30", "seconds a wait lasts before it logs who is where",
       low=0, strict=True),
    _v("DEADLOCK", "flag", "1", "the deadlock check (0 for programs that block on purpose "
       "on something rankwise does not see)"),
    _v("DEADLOCK_AFTER", "number", "1", "seconds every rank must have waited before the "
       "deadlock check looks", low=0, strict=True),
    _v("NAN_CHECK", "flag", "0", "a reducing collective whose input holds a NaN or Inf "
       "raises on every rank before any data moves, naming the rank (docs/stragglers.md)"),
    _v("STRAGGLERS", "flag", "1", "straggler attribution: which rank the others wait "
       "for, and where it spends the time (docs/stragglers.md)"),
    _v("DIAGNOSIS", "flag", "1", "call-site capture (0: every call's site is unknown; "
       "benchmarks)"),
    _v("DOCTOR", "flag", "1", "explain a failed init by checking this machine's network "
       "and environment"),
    _v("DUMP", "text", "", "a directory: every rank writes rank<N>.json there when it "
       "fails (rankwise analyze merges them)"),
    _v("TRACE", "text", "", "a directory: every rank records a timeline of its calls "
       "there"),
    _v("SHM_SLOT_BYTES", "int", None, "the shm engine's slot size (default 1 MiB, fitted "
       "to /dev/shm)", low=0, strict=True),
    _v("SHM_RING_BYTES", "int", None, "each shm transport ring's size (default 64 MiB "
       "shared by the rings, 256 KiB to 4 MiB each)", low=0),
    _v("SHM_METHOD", "choice", "auto", "how a shared segment is shared", "auto", "memfd",
       "file"),
    _v("SHM_SPIN_US", "number", None, "microseconds a shm wait spins (default 50, 0 when "
       "ranks outnumber CPUs)", low=0),
    _v("SHM_YIELD_US", "number", None, "microseconds a shm wait yields before it sleeps "
       "(default 2000, 1000 when ranks outnumber CPUs)", low=0),
    _v("SHM_SKEW_US", "number", None, "microseconds of skew after which a shm wait sleeps "
       "at once (default off, a quarter of the yield when ranks outnumber CPUs)", low=0),
    _v("HUGEPAGES", "flag", "1", "transparent huge pages for big buffers and segments"),
    _v("PARKED_PER_PEER", "int", str(64 << 20), "bytes of early messages kept per peer "
       "before its sender waits", low=0, strict=True),
    _v("PARKED_TOTAL", "int", str(256 << 20), "bytes of early messages kept in all",
       low=0, strict=True),
    _v("RING_THRESHOLD", "int", _KIB, "bytes from which all_reduce takes the ring (below: "
       "recursive doubling)", low=0),
    _v("DRIVE_BYTES", "int", _KIB, "bytes from which a blocking collective reads its own "
       "frames", low=0),
    _v("TIERS_BYTES", "int", _KIB, "bytes from which all_reduce goes through the tiers",
       low=0),
    _v("SEGMENT_BYTES", "int", str(4 << 20), "the ring's segment size in bytes", low=0,
       strict=True),
    _v("CTS_BYTES", "int", str(1 << 20), "bytes from which a ring chunk waits for a "
       "clear-to-send", low=0),
    _v("SOCKBUF", "int", str(4 << 20), "socket buffer bytes per direction and connection",
       low=0, strict=True),
    _v("RCVLOWAT", "int", _KIB, "the most bytes a reader asks the kernel to gather before "
       "it wakes", low=0),
    _v("TORCH_CHECKS", "choice", "off", "checks under plain torch scripts: a group asked "
       "of gloo (cpu) or of NCCL too (on) runs as backend rankwise over it (rankwise run "
       "sets cpu unless --checks; read at import torch by rankwise_autoload, which tests "
       "keep in step)", "off", "cpu", "on"),
    _v("TORCH_ROUTE", "choice", "backend", "how torch 2.14+ sees backend rankwise: a c10d "
       "Backend under torch's own ProcessGroup, or the ProcessGroup subclass older torch "
       "gets (to compare the two)", "backend", "subclass"),
    _v("TORCH_ANY", "flag", "0", "run with a torch outside the tested range"),
    _v("JOIN", "flag", "0", "this process joins a running job at its next "
       "rankwise.grow() (rankwise run --respawn sets it)"),
    _v("LIVE", "flag", "0", "publish for rankwise run's live page", who="launcher"),
    _v("LIVE_LINGER", "number", "0", "seconds the live page stays up after the job ended",
       low=0),
    _v("LAUNCHED", "flag", "0", "this process is a worker of rankwise run", who="launcher"),
    _v("AGENT_STORE", "flag", "0", "the launcher hosts the store (ranks do not)",
       who="launcher"),
    _v("RESTART_COUNT", "int", None, "the attempt number (TORCHELASTIC_RESTART_COUNT's "
       "twin)", low=0, who="launcher"),
    _v("ERROR_FILE", "text", "", "where a worker writes its uncaught exception "
       "(TORCHELASTIC_ERROR_FILE's twin)", who="launcher"),
    _v("NODE_NEWS", "text", "", "the pipe a worker hears its launcher's node verdicts on",
       who="launcher"),
    _v("JOB_MARKER", "text", "", "marks every process of one job, for the launcher's "
       "watchdog", who="launcher"),
    _v("TENSOR_PATH", "choice", "", "CPU torch tensors take the device path (no GPU to "
       "test on)", "device", "staged", who="tests"),
    _v("TEST_START", "choice", "forkserver", "how rankwise.testing starts ranks",
       "forkserver", "spawn", who="tests"),
)}


def _get(name: str, env: Mapping[str, str] | None) -> tuple[Var, str]:
    var = VARIABLES[name]  # a KeyError here is a reader's typo, not the user's
    raw = (os.environ if env is None else env).get(name, "")
    return var, raw if raw.strip() else ""


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    var, raw = _get(name, env)
    assert var.kind == "flag", name
    return bool(var.parse(raw or str(var.default)))


def choice(name: str, env: Mapping[str, str] | None = None) -> str:
    """The value, lower-cased; the default ("" for none) when unset or empty."""
    var, raw = _get(name, env)
    assert var.kind == "choice", name
    return str(var.parse(raw)) if raw else str(var.default)


def choices(name: str) -> tuple[str, ...]:
    return VARIABLES[name].choices


def integer(name: str, default: int | None = None,
            env: Mapping[str, str] | None = None) -> int:
    """The value; when unset, ``default`` (for a computed default) else the declared one."""
    return int(_numeric(name, "int", default, env))


def number(name: str, default: float | None = None,
           env: Mapping[str, str] | None = None) -> float:
    """As :func:`integer`, for a float."""
    return float(_numeric(name, "number", default, env))


def _numeric(name: str, kind: str, default: float | None,
             env: Mapping[str, str] | None) -> bool | str | int | float:
    var, raw = _get(name, env)
    assert var.kind == kind, name
    if raw:
        return var.parse(raw)
    return default if default is not None else str(var.default)


def text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value as written (validated for its kind), None when unset or empty."""
    var, raw = _get(name, env)
    if not raw:
        return None
    var.parse(raw)
    return raw


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Validate every declared variable that is set (before any I/O)."""
    for name in VARIABLES:
        text(name, env)


def table() -> str:
    """README's table of variables (tests/test_settings.py keeps README equal to it)."""
    rows = ["| variable | takes | default | what it does |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        default = "computed" if v.default is None else (v.default or "unset")
        if v.kind == "int" and default.isdigit() and int(default) >= 1 << 20:
            default = f"{int(default) >> 20} MiB"
        elif v.kind == "int" and default.isdigit() and int(default) >= 1 << 10:
            default = f"{int(default) >> 10} KiB"
        who = {"user": "", "launcher": " (set by rankwise run)", "tests": " (tests)"}[v.who]
        rows.append(f"| `{v.name}` | {v.accepts()} | {default} | {v.doc}{who} |")
    return "\n".join(rows)
