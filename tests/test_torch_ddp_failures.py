"""A failure inside torch's DDP on backend "rankwise" reads as rankwise's (issue 47): the
message torch builds names no frame of rankwise's (nor does the traceback as printed,
nor the launcher's summary), ``rankwise.unwrap`` gives rankwise's exception back, and the
rank's line reports it, not torch's wrapper. Each way torch's C++ passes it on: the
reducer's bucket future, a Python comm hook's ``then``, a collective torch's C++ calls
(DDP's parameter check, and ``_broadcast_coalesced`` of the parameters, at construction),
and a mismatch met in backward."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _autoload import autoload_env
from _procs import run
from launch_scripts.helpers import SCRIPTS, launcher_cmd

import rankwise

pytestmark = [pytest.mark.procs, pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("torch.distributed")
from rankwise.torch._register import c10d_route

SCRIPT = str(SCRIPTS / "torch_ddp_peer_dies.py")
#: rankwise's own files: none of them may be named in what the user sees
PACKAGE = os.path.dirname(rankwise.__file__) + os.sep
#: what torch's C++ puts before rankwise's message, per mode (None: raised as it is).
#: Under torch's own ``ProcessGroup`` (2.14+) the bucket's future is failed in C++ by a
#: ``then`` (``_work.ChainedAsyncWork``), so torch's ``then`` prefix leads, and a comm
#: hook's own ``then`` adds its prefix to that error's text.
_THEN = "Got the following error when running the callback: "
PREFIX = ({"backward": _THEN, "hook": f"{_THEN}RuntimeError: {_THEN}", "mismatch": _THEN}
          if c10d_route() else
          {"backward": "Cannot extract tensors from value: ", "hook": _THEN,
           "mismatch": "Cannot extract tensors from value: "})
PREFIX.update(construct=None, broadcast=None)


def _line_of(code: str) -> int:
    """The line of SCRIPT that holds ``code``."""
    lines = Path(SCRIPT).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if code in text)


def _launch(tmp_path: Path, mode: str) -> tuple[dict[str, dict[str, object]], str]:
    res = run(launcher_cmd("--no-live", "-n", "2", SCRIPT, str(tmp_path), mode),
              env=autoload_env(tmp_path), timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("seen*.json")}
    return seen, res.stderr


@pytest.mark.parametrize("mode", ["backward", "hook", "construct", "broadcast"])
def test_a_dead_peer_inside_torchs_ddp_reads_as_rankwises(tmp_path: Path, mode: str) -> None:
    seen, stderr = _launch(tmp_path, mode)
    mine = seen["seen0"]
    prefix = PREFIX[mode]
    message = str(mine["message"])
    assert message.startswith(f"{prefix or ''}{'PeerFailure: ' if prefix else ''}"
                              "rank 1 died"), mine  # torch's prefix (if any), then ours
    assert PACKAGE not in message and PACKAGE not in str(mine["printed"]), mine["printed"]
    if prefix:
        at = message[message.index("\nAt:\n"):]
        assert "torch" in at, at  # torch's frames (and the user's) are listed, not ours
    assert (mine["unwrapped"], mine["peer"], mine["caught"], mine["same"]) == \
        ("PeerFailure", 1, True, True), mine
    line = next(x for x in stderr.splitlines() if x.startswith("[rank0]: "))
    assert line.startswith("[rank0]: rank 0: PeerFailure: rank 1 died"), line
    assert "torch_ddp_peer_dies.py:" in line, line  # raised at the user's line
    summary = stderr[stderr.index("rankwise run: job failed"):]
    assert "Cannot extract" not in summary and "Got the following" not in summary, summary


def test_a_mismatch_in_torchs_ddp_backward_reads_as_rankwises(tmp_path: Path) -> None:
    """rank 1's extra all_reduce meets rank 0's gradient bucket: both raise the mismatch
    naming both lines; the summary's traceback (the first rank to fail) has no frame of
    rankwise's."""
    seen, stderr = _launch(tmp_path, "mismatch")
    assert set(seen) == {"seen0", "seen1"}, seen
    for rank, what in seen.items():
        assert what["unwrapped"] == "CollectiveMismatch" and what["caught"], (rank, what)
        assert what["same"], (rank, what)
        assert PACKAGE not in str(what["printed"]), (rank, what["printed"])
        for at in (_line_of("dist.all_reduce(torch.ones(3))"), _line_of("loss.backward()")):
            assert f"torch_ddp_peer_dies.py:{at}" in str(what["message"]), what["message"]
    assert str(seen["seen0"]["message"]).startswith(
        f"{PREFIX['mismatch']}CollectiveMismatch: "), seen["seen0"]
    summary = stderr[stderr.index("rankwise run: job failed"):]
    assert "traceback  :" in summary and "CollectiveMismatch: " in summary, summary
    assert PACKAGE not in summary and "Cannot extract" not in summary, summary
    for r in (0, 1):
        line = next(x for x in stderr.splitlines() if x.startswith(f"[rank{r}]: "))
        assert line.startswith(f"[rank{r}]: rank {r}: CollectiveMismatch: "), line
