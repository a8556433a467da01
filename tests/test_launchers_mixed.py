"""Issue 14 item 5: a rankwise script under torchrun says in one line what to run instead
(it used to wait the whole 1800 s timeout on torch's store and then blame the store)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch_scripts.helpers import env, free_port

pytest.importorskip("torch")

SCRIPT = "import rankwise as dist\ndist.init_process_group('gloo')\nprint('joined')\n"


def test_rankwise_script_under_torchrun_says_what_to_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "joined" not in out
    lines = [ln for ln in out.splitlines() if "started by torchrun" in ln]
    assert lines, out
    assert "start it with `rankwise run` instead" in lines[0]
