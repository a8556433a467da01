"""Lightning on backend "rankwise" (issue 35): ``DDPStrategy(process_group_backend=
"rankwise")`` under ``rankwise run`` trains 2 epochs on 2 ranks and ends with gloo's weights
bit for bit. Skipped where Lightning is not installed (the dev extra pins it)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

from launch_scripts.helpers import SCRIPTS, run_launcher

pytestmark = [pytest.mark.procs, pytest.mark.torch, pytest.mark.slow]

LINE = r"lightning rank (\d) of 2 on (\S+) steps (\d+) weights (.*)"


def _weights(backend: str) -> set[str]:
    # the gloo reference runs as asked (with the checks on, `rankwise run` would take its
    # gloo over: tests/test_torch_frameworks_plain.py)
    checks = ["--checks=off"] if backend == "gloo" else []
    proc = run_launcher(*checks, "-n", "2", str(SCRIPTS / "lightning_recipe.py"), backend,
                        timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = re.findall(LINE, out)
    assert sorted(line[0] for line in lines) == ["0", "1"], out[-4000:]
    assert {line[1:3] for line in lines} == {(backend, "8")}, lines
    return {line[3] for line in lines}


def test_lightning_ddp_trains_on_rankwise_as_on_gloo() -> None:
    ours = _weights("rankwise")
    assert len(ours) == 1  # every rank ends with the same weights
    assert ours == _weights("gloo")
