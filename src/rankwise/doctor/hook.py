"""On an init failure, add the doctor's relevant findings to the exception.

Only the checks that can explain a failing ``init_process_group`` run (not CPU or
/dev/shm sizing), torch is not imported for it, name resolution and port probes have
short timeouts, and nothing here may raise: the original error is what matters.
``RANKWISE_DOCTOR=0`` turns it off.
"""

from __future__ import annotations

import sys

from .. import settings
from .findings import Finding
from .inputs import gather
from .probes import GpuProbes, NetProbes
from .report import render_text
from .run import run_checks

__all__ = ["INIT_CHECKS", "explain_init_failure", "init_findings"]

INIT_CHECKS = ("job", "gpu", "interfaces", "master", "hostname", "port", "files", "token")


def init_findings(hosting: bool | None, token: bytes | None) -> list[Finding]:
    """The problems the doctor sees in this process's environment right now.
    ``hosting``: this process was about to start the store (its port should be free);
    ``False``: the store should answer on MASTER_ADDR:MASTER_PORT; ``None``: decide from
    the environment (rank 0 without a launcher's store hosts it). ``token``: the one init
    uses (its probe of the store must not count as a stranger failing the token check)."""
    net = NetProbes(resolve_timeout=1.5, connect_timeout=0.5, token=token, token_from_env=False)
    # torch only if the program imported it already; a hung driver costs at most 3 s
    inp = gather(hosting=hosting, net=net, gpus=GpuProbes(import_torch=False, timeout=3.0))
    return [f for f in run_checks(inp, INIT_CHECKS) if f.problem]


def explain_init_failure(exc: BaseException, hosting: bool | None,
                         token: bytes | None = None) -> None:
    """Attach the findings to ``exc`` (a note, shown with its traceback); never raises."""
    if not settings.flag("RANKWISE_DOCTOR"):
        return
    try:
        findings = init_findings(hosting, token)
        if not findings:
            return
        text = render_text(findings).replace("rankwise doctor:", "rankwise doctor, on this "
                                             "init failure:", 1)
        add_note = getattr(exc, "add_note", None)
        if callable(add_note):
            add_note(text)
        else:  # Python 3.10
            sys.stderr.write(text + "\n")
    except Exception:  # noqa: BLE001, S110 - the init error is what the user must see
        pass
