"""torch's ``@record`` error files, read into the launcher's summary like rankwise's own.

Why: a plain torch script never imports rankwise, so rankwise's excepthook writes nothing;
torch's ``torch.distributed.elastic.multiprocessing.errors.record`` writes the exception to
``TORCHELASTIC_ERROR_FILE`` (the same path the launcher gives ``RANKWISE_ERROR_FILE``) as::

    {"message": {"message": "ValueError: bad batch",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

(newer torch may write ``"message"`` as a plain string). This turns such a record into the
fields ``summary`` reads. torch's timestamp has whole seconds only, too coarse to tell the
rank that raised from the ranks that failed because of it a few milliseconds later, so the
file's modification time (nanoseconds) is used instead. A failure that is torch's report of
a lost peer (gloo's "Connection closed by peer", a store or NCCL communicator error after
another rank died) is marked ``TorchPeerLost``: a consequence, never the root cause.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["PEER_LOST", "from_torch_record"]

#: the class name that marks a torch failure as a consequence of another rank's
PEER_LOST = "TorchPeerLost"

_PEER_LOST_TEXT = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout|connection refused|"
    r"failed to recv|failed to send|read error|ECONNRESET|DistNetworkError|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout)",
    re.IGNORECASE,
)
_PEER_LOST_TYPES = frozenset({"DistNetworkError", "DistStoreError"})


def _message(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    msg = data.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        return str(msg.get("message", "")), extra if isinstance(extra, dict) else {}
    return str(msg or ""), {}


def from_torch_record(data: dict[str, Any], path: str) -> dict[str, Any] | None:
    """``data`` (torch's error file at ``path``) in rankwise's error-file fields; None if
    it is not torch's format."""
    if "message" not in data or "exc_type" in data:
        return None
    text, extra = _message(data)
    exc_type, sep, message = text.partition(": ")
    if not sep or " " in exc_type:
        exc_type, message = "Exception", text
    traceback = str(extra.get("py_callstack") or text)
    try:
        stamp = os.stat(path).st_mtime
    except OSError:
        stamp = float(extra.get("timestamp") or 0)
    lost = exc_type in _PEER_LOST_TYPES or bool(_PEER_LOST_TEXT.search(text))
    return {
        "exc_type": exc_type,
        "message": message,
        "traceback": traceback,
        "timestamp": stamp,
        "exc_mro": [exc_type, PEER_LOST] if lost else [exc_type],
        "where": "",
        "source": "torch @record",
    }
