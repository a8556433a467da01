"""benchmarks/device_path.py drives a two-rank job over the fake device path and ends
with its one-line verdict (a short run: the ratios are measured on a quiet machine, not
asserted here)."""

from __future__ import annotations

import re
import sys

import pytest
from launch_scripts.helpers import ROOT, env, run_bounded

#: hard bound on the run: two short jobs (world 1, world 2) on a loaded 2-core machine
TIMEOUT = 240.0
LAST = re.compile(r"device path per call \(world 2, checks on\): rankwise API \d+\.\dx, "
                  r"torch API -?\d+\.\dx, 1 MiB \d+\.\dx, async\+wait \d+\.\dx "
                  r"torch's dispatch \(\d+\.\d us\)")


@pytest.mark.procs
@pytest.mark.slow
def test_device_path_benchmark_ends_with_its_line() -> None:
    environ = env()
    environ.pop("RANKWISE_CHECK", None)  # the default: checks on
    proc = run_bounded([sys.executable, str(ROOT / "benchmarks" / "device_path.py"),
                        "--calls", "30", "--rounds", "2"], environ, TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert LAST.fullmatch(lines[-1]), proc.stdout[-4000:]
    assert lines[-2].startswith("device path per call (world 1, checks on): "), proc.stdout
    assert sum("caller CPU per call" in line for line in lines) == 2, proc.stdout
