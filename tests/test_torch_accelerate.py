"""accelerate on backend "rankwise" (issue 35): the README's recipe, under ``rankwise run``,
trains with torch's DDP over rankwise and every rank ends with the same weights. Skipped
where accelerate is not installed (it is not among the pinned development packages)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from launch_scripts.helpers import SCRIPTS, run_launcher

pytestmark = [pytest.mark.procs, pytest.mark.torch, pytest.mark.slow]


def test_the_readme_recipe_trains_on_rankwise() -> None:
    proc = run_launcher("-n", "2", str(SCRIPTS / "accelerate_recipe.py"), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = re.findall(r"accelerate rank (\d) of 2 on (\S+) (\S+) reduce (\S+) weights (.*)",
                       out)
    assert sorted(line[0] for line in lines) == ["0", "1"], out[-4000:]
    assert {line[1:4] for line in lines} == {("rankwise", "DistributedDataParallel", "2.0")}
    assert lines[0][4] == lines[1][4]  # gradients were averaged: the same weights
