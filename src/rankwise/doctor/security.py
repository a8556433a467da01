"""The shared token: a token file others can read gives them the job (the token is the
only thing that keeps strangers off the store), and several nodes without a token are
open to anyone who reaches the port."""

from __future__ import annotations

import os
import stat

from .. import settings
from .findings import Finding, Severity
from .inputs import Inputs

__all__ = ["check_token"]


def check_token(inp: Inputs) -> list[Finding]:
    path = inp.token_file or settings.text("RANKWISE_TOKEN_FILE", inp.env)
    found: list[Finding] = []
    if path:
        found += _token_file(path)
        if settings.text("RANKWISE_TOKEN", inp.env) and not inp.token_file:
            found.append(Finding("token", Severity.INFO,
                                 "RANKWISE_TOKEN is set, so RANKWISE_TOKEN_FILE is not read"))
    elif not settings.text("RANKWISE_TOKEN", inp.env) and inp.multi_node():
        found.append(Finding(
            "token", Severity.WARNING, "a job over several nodes without a shared token",
            "neither RANKWISE_TOKEN nor RANKWISE_TOKEN_FILE is set",
            "anyone who reaches MASTER_PORT can join or abort the job: put a random secret "
            "(`openssl rand -hex 32`) in a file readable only by you on every node and pass "
            "--token-file (or RANKWISE_TOKEN_FILE)"))
    return found


def _token_file(path: str) -> list[Finding]:
    try:
        st = os.stat(path)
    except OSError as exc:
        return [Finding("token", Severity.ERROR, f"the token file {path} cannot be read",
                        str(exc), "create it on every node (same content), mode 600")]
    if not stat.S_ISREG(st.st_mode):
        return [Finding("token", Severity.ERROR, f"the token file {path} is not a file",
                        f"mode {stat.filemode(st.st_mode)}", "point to a regular file")]
    found: list[Finding] = []
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        found.append(Finding(
            "token", Severity.ERROR, f"the token file {path} is readable by other users",
            f"mode {mode:04o} ({stat.filemode(st.st_mode)})",
            f"chmod 600 {path}: whoever reads the token can join or abort the job"))
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        found.append(Finding(
            "token", Severity.WARNING, f"the token file {path} belongs to another user",
            f"owner uid {st.st_uid}, this process runs as uid {os.getuid()}",
            "keep the token in a file of your own (chown or copy it, then chmod 600)"))
    if st.st_size == 0:
        found.append(Finding("token", Severity.ERROR, f"the token file {path} is empty", "",
                             "write a random secret into it: `openssl rand -hex 32 > FILE`"))
    return found
