"""Run the checks: every check is isolated (one that raises becomes a finding, it never
stops the others) and its real I/O goes through the bounded probes of ``probes.py``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from .findings import Finding, Severity
from .gpu import check_gpus
from .inputs import Inputs, gather
from .jobenv import check_job_env
from .network import check_hostname, check_ifnames, check_master_addr, check_master_port
from .report import render_json, render_text
from .resources import check_cpus, check_open_files, check_shm
from .security import check_token
from .torchver import check_torch_version

__all__ = ["CHECKS", "Check", "doctor", "run_checks"]

Check = Callable[[Inputs], list[Finding]]

#: in report order: the job's identity, placement, network, resources, security
CHECKS: dict[str, Check] = {
    "job": check_job_env,
    "gpu": check_gpus,
    "torch": check_torch_version,
    "interfaces": check_ifnames,
    "master": check_master_addr,
    "hostname": check_hostname,
    "port": check_master_port,
    "shm": check_shm,
    "files": check_open_files,
    "cpus": check_cpus,
    "token": check_token,
}


def run_checks(inp: Inputs, names: Sequence[str] | None = None) -> list[Finding]:
    """The findings of the named checks (all by default), in ``CHECKS`` order."""
    findings: list[Finding] = []
    for name, check in CHECKS.items():
        if names is not None and name not in names:
            continue
        try:
            findings += check(inp)
        except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
            findings.append(Finding(name, Severity.WARNING, f"the {name} check could not run",
                                    f"{type(exc).__name__}: {exc}",
                                    "the evidence says what failed (a hung driver, an unreadable "
                                    "file); fix that, or report it to rankwise"))
    return findings


def doctor(*, nproc: int | None = None, nnodes: int | None = None,
           num_workers: int | None = None, master_addr: str | None = None,
           master_port: int | None = None, token_file: str | None = None,
           as_json: bool = False, verbose: bool = False) -> int:
    """``rankwise doctor``: check this machine, print the report; 1 if a problem was found."""
    env = dict(os.environ)
    if master_addr is not None:
        env["MASTER_ADDR"] = master_addr
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    findings = run_checks(gather(env, nproc=nproc, nnodes=nnodes, num_workers=num_workers,
                                 token_file=token_file))
    out = render_json(findings) if as_json else render_text(findings, verbose)
    sys.stdout.write(out + "\n")
    return 1 if any(f.problem for f in findings) else 0
