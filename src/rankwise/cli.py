"""``rankwise run`` / ``bench`` / ``analyze`` / ``doctor``: the command line, with torchrun's
spellings accepted.

Only argument parsing lives here; :mod:`rankwise.launch.job` runs the job,
:mod:`rankwise.bench.run` owns the ``bench`` subcommand, :mod:`rankwise.diagnosis.analyze`
``analyze``, and :mod:`rankwise.doctor` the checks of ``doctor``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rankwise_autoload import ENV as CHECKS_ENV
from rankwise_autoload import MODES
from rankwise_autoload import mode as checks_mode

from . import settings
from .launch.job import JobOptions, run_job

__all__ = ["build_parser", "main", "parse_nnodes", "parse_run_args"]


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    lo, _, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return bounds


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc-per-node must be a number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--nproc-per-node must be >= 1, got {n}")
    return n


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, 0
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rdzv-endpoint must be HOST[:PORT], got {text!r}") from None


def _rdzv_backend(text: str) -> str:
    if text not in ("c10d", "static"):
        raise argparse.ArgumentTypeError(
            f"--rdzv-backend {text} is not supported: rankwise's rendezvous runs on its own "
            "store on node 0 (--rdzv-endpoint HOST:PORT); use c10d or static")
    return text


def _local_ranks(text: str) -> frozenset[int]:
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--local-ranks-filter must be a comma-separated list of integers, e.g. 0,1; "
            f"got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"--local-ranks-filter: no negative ranks, got {text!r}")
    return ranks


def _add(p: argparse.ArgumentParser, *names: str, **kw: object) -> None:
    """Add an option under its dashed name plus torchrun's underscored spelling."""
    spellings = list(names)
    spellings += ["--" + n[2:].replace("-", "_") for n in names if n.startswith("--") and "-" in n[2:]]
    p.add_argument(*spellings, **kw)  # type: ignore[arg-type]


def _add_run_options(p: argparse.ArgumentParser) -> None:
    _add(p, "-n", "--nproc-per-node", dest="nproc", type=_nproc, default=1,
         help="worker processes on this node (default 1; 'auto' = CPU count)")
    _add(p, "--nnodes", type=parse_nnodes, default=(1, 1), help="nodes: N or MIN:MAX (default 1)")
    _add(p, "--node-rank", type=int, default=None,
         help="this node's rank (default: 0 for one node, else assigned in order of arrival)")
    _add(p, "--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    _add(p, "--master-port", type=int, default=0,
         help="store port on node 0 (default: a free port for one node; required for several)")
    _add(p, "--rdzv-endpoint", type=_endpoint, default=None,
         help="HOST:PORT of the store; overrides --master-addr/--master-port")
    _add(p, "--rdzv-id", default=None, help="job id; every node must give the same one")
    _add(p, "--rdzv-backend", type=_rdzv_backend, default="c10d",
         help="c10d or static (torchrun's; both mean rankwise's own store on node 0)")
    _add(p, "--rdzv-conf", default="", help="accepted for torchrun compatibility (ignored)")
    _add(p, "--standalone", action="store_true", help="one node on a free port (the default)")
    _add(p, "--max-restarts", type=int, default=0, help="restart the group up to N times")
    _add(p, "--monitor-interval", type=float, default=None,
         help="accepted for torchrun compatibility: exits are noticed at once, not polled")
    _add(p, "--start-method", choices=["spawn", "fork", "forkserver"], default=None,
         help="accepted for torchrun compatibility: workers are always fresh processes")
    _add(p, "--role", default="default", help="ROLE_NAME of the workers (torchrun's --role)")
    _add(p, "--on-failure", choices=("stop", "continue"), default="stop",
         help="when a rank fails: 'stop' the job (default) or 'continue': report it and "
              "keep the others running, so they can recover in place with rankwise.shrink() "
              "(exit status 3 at the end when ranks were lost; docs/recovery.md)")
    _add(p, "--respawn", type=int, default=0, metavar="N",
         help="with --on-failure=continue: start a lost rank again, as a process that joins "
              "at the others' next rankwise.grow() (RANKWISE_JOIN=1), up to N times per node")
    _add(p, "--checks", choices=MODES, default=None,
         help="torch.distributed groups of a script that asks for 'gloo', 'nccl' or torch's "
              "default: 'cpu' (the default, or $RANKWISE_TORCH_CHECKS) makes CPU ones backend "
              "'rankwise' over torch's gloo, with rankwise's checks; 'on' CUDA ones too "
              "(over NCCL; not yet verified on a GPU); 'off' runs them as asked")
    _add(p, "--log-dir", default=None, help="write each rank's stdout/stderr under this directory")
    _add(p, "-r", "--redirects", default=None,
         help="torchrun's: with --log-dir, output goes to the log files only (the default "
              "unless --tee)")
    _add(p, "-t", "--tee", nargs="?", const="3", default=None,
         help="with --log-dir, also copy output to the console")
    _add(p, "--local-ranks-filter", type=_local_ranks, default=None,
         help="comma-separated local ranks whose output reaches the console (log files "
              "keep every rank's)")
    prefix = p.add_mutually_exclusive_group()
    prefix.add_argument("--prefix", dest="prefix", action="store_true", default=None,
                        help="prefix each output line with [rank N] (default when a terminal)")
    prefix.add_argument("--no-prefix", dest="prefix", action="store_false")
    _add(p, "--grace", type=float, default=5.0,
         help="seconds survivors get after a failure before SIGTERM, and again before SIGKILL")
    _add(p, "--timeout", "--rdzv-timeout", type=float, default=300.0,
         help="rendezvous timeout in seconds (how long a launcher waits for the other nodes)")
    _add(p, "--no-start-gate", dest="start_together", action="store_false",
         help="let each worker run as soon as it is spawned (default: hold each until this "
              "node's last one is spawned, then release all together)")
    _add(p, "--token-file", default=None,
         help="file holding the job's shared secret (default: $RANKWISE_TOKEN_FILE, "
              "$RANKWISE_TOKEN, else a random one per job on one node)")
    _add(p, "--token", default=None,
         help="shared secret on the command line: visible to every user in `ps`; prefer "
              "--token-file or $RANKWISE_TOKEN")
    live = p.add_mutually_exclusive_group()
    live.add_argument("--live", metavar="HOST:PORT", default="127.0.0.1:0",
                      help="serve the live job page here (default 127.0.0.1 on a free port; "
                           "its address, with its token, is printed at start; see "
                           "docs/live.md)")
    live.add_argument("--no-live", dest="live", action="store_const", const=None,
                      help="no live job page")
    _add(p, "--nan-check", action="store_true",
         help="raise on every rank before a reducing collective whose input holds a NaN or "
              "Inf, naming the rank (and a DDP model's parameters); sets RANKWISE_NAN_CHECK=1 "
              "(docs/stragglers.md)")
    _add(p, "--no-stragglers", action="store_true",
         help="no straggler attribution (RANKWISE_STRAGGLERS=0; docs/stragglers.md)")
    _add(p, "--no-python", action="store_true", help="run the script as an executable")
    _add(p, "-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankwise", description="rankwise command line")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="launch a distributed job (like torchrun)",
                         description="Start N workers per node with torchrun's environment, "
                                     "watch them, and tear the whole group down on a failure.")
    _add_run_options(run)
    # listed for `rankwise --help` only: main() hands `bench ...` to bench.main before this
    # parser sees it, so `rankwise run` never imports the benchmark's modules
    sub.add_parser("bench", help="time collectives: rankwise vs torch gloo (and MPI); "
                                 "see `rankwise bench --help`", add_help=False)
    sub.add_parser("analyze", help="merge the RANKWISE_DUMP=dir post-mortem files of a "
                                   "job into one report; see `rankwise analyze --help`",
                   add_help=False)
    _add_doctor_options(sub.add_parser(
        "doctor", help="check this machine's environment for a distributed job",
        description="Check the environment problems that make distributed jobs fail (GPU "
                    "placement, network variables, MASTER_ADDR/PORT, /dev/shm, limits, CPUs per "
                    "rank, token file). Exit code 0: no problem found; 1: a problem."))
    return parser


def _add_doctor_options(p: argparse.ArgumentParser) -> None:
    _add(p, "-n", "--nproc-per-node", dest="nproc", type=_nproc, default=None,
         help="ranks per node you plan to start (default: $LOCAL_WORLD_SIZE)")
    _add(p, "--nnodes", type=parse_nnodes, default=None, help="nodes of the job: N or MIN:MAX")
    _add(p, "--num-workers", type=int, default=None,
         help="DataLoader num_workers per rank (the doctor cannot see your DataLoader)")
    _add(p, "--master-addr", default=None, help="default: $MASTER_ADDR")
    _add(p, "--master-port", type=int, default=None, help="default: $MASTER_PORT")
    _add(p, "--token-file", default=None, help="default: $RANKWISE_TOKEN_FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-v", "--verbose", action="store_true", help="also show what is fine")


def parse_run_args(argv: Sequence[str]) -> JobOptions:
    """``rankwise run`` arguments (without the ``run``) -> JobOptions; exits on misuse."""
    parser = build_parser()
    ns = parser.parse_args(["run", *argv])
    if ns.no_python and ns.module:
        parser.error("--no-python and -m cannot be combined")
    if ns.respawn < 0:
        parser.error(f"--respawn must be >= 0, got {ns.respawn}")
    if ns.respawn and ns.on_failure != "continue":
        parser.error("--respawn needs --on-failure=continue (with 'stop' a lost rank ends "
                     "the job, and there is no running world to join)")
    if ns.nan_check:  # the workers inherit the launcher's environment
        os.environ["RANKWISE_NAN_CHECK"] = "1"
    if ns.no_stragglers:
        os.environ["RANKWISE_STRAGGLERS"] = "0"
    if ns.module:
        cmd = [sys.executable, "-u", "-m", ns.script, *ns.script_args]
    elif ns.no_python:
        cmd = [ns.script, *ns.script_args]
    else:
        cmd = [sys.executable, "-u", ns.script, *ns.script_args]
    addr, port = ns.rdzv_endpoint or (ns.master_addr, ns.master_port)
    if ns.standalone and ns.nnodes[1] > 1:
        parser.error("--standalone is for one node; several nodes need --rdzv-endpoint or "
                     "--master-addr/--master-port")
    if ns.nnodes[1] > 1 and port == 0:
        parser.error("several nodes need a known store port: give --master-port or "
                     "--rdzv-endpoint HOST:PORT (the same on every node)")
    if ns.node_rank is not None and not 0 <= ns.node_rank < ns.nnodes[1]:
        parser.error(f"--node-rank {ns.node_rank} is outside 0..{ns.nnodes[1] - 1}")
    return JobOptions(
        cmd=cmd, nproc=ns.nproc, min_nodes=ns.nnodes[0], max_nodes=ns.nnodes[1],
        node_rank=ns.node_rank, master_addr=addr, master_port=port, rdzv_id=ns.rdzv_id,
        max_restarts=ns.max_restarts, log_dir=ns.log_dir, tee=ns.tee is not None,
        prefix=sys.stdout.isatty() if ns.prefix is None else ns.prefix, grace=ns.grace,
        timeout=ns.timeout, token=_token(parser, ns), start_together=ns.start_together,
        live=_live(parser, ns.live),
        role=ns.role, console_ranks=ns.local_ranks_filter,
        on_failure=ns.on_failure, respawn=ns.respawn, checks=_checks(parser, ns.checks),
    )


def _checks(parser: argparse.ArgumentParser, given: str | None) -> str:
    """``--checks``, else ``$RANKWISE_TORCH_CHECKS`` (checked here, before any process
    starts), else ``cpu``."""
    if given is not None:
        return given
    if not os.environ.get(CHECKS_ENV, "").strip():
        return "cpu"
    try:
        return checks_mode(os.environ)
    except ValueError as exc:
        parser.error(str(exc))


def _live(parser: argparse.ArgumentParser, address: str | None) -> str | None:
    """``--live`` checked before anything starts (a bad address is an error, not a page
    that silently never comes)."""
    if address is None:
        return None
    from .live.server import parse_live_address

    try:
        parse_live_address(address)
    except ValueError as exc:
        parser.error(str(exc))
    return address


def _token(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """``--token-file``, else ``--token``, ``$RANKWISE_TOKEN``, ``$RANKWISE_TOKEN_FILE``."""
    from .errors import AuthError
    from .wire.auth import read_token_file

    path = ns.token_file or (None if ns.token or settings.text("RANKWISE_TOKEN")
                             else settings.text("RANKWISE_TOKEN_FILE"))
    if path:
        try:
            return read_token_file(path)
        except AuthError as exc:
            parser.error(str(exc))
    if ns.token:
        print("rankwise run: warning: --token is visible to every user of this machine "
              "(ps, /proc/<pid>/cmdline); use --token-file or RANKWISE_TOKEN instead",
              file=sys.stderr)
    return ns.token or settings.text("RANKWISE_TOKEN")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rankwise`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        from .bench.run import main as bench_main

        return bench_main(args[1:])
    if args and args[0] == "analyze":
        from .diagnosis.analyze import main as analyze_main

        return analyze_main(args[1:])
    if args and args[0] == "doctor":
        from .doctor.run import doctor

        ns = build_parser().parse_args(args)
        return doctor(nproc=ns.nproc, nnodes=ns.nnodes and ns.nnodes[1],
                      num_workers=ns.num_workers, master_addr=ns.master_addr,
                      master_port=ns.master_port, token_file=ns.token_file, as_json=ns.json,
                      verbose=ns.verbose)
    if not args or args[0] != "run":
        build_parser().parse_args(args)  # prints usage / help and exits
        return 2
    return run_job(parse_run_args(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
