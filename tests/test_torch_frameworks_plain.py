"""accelerate and Lightning with their own backend name ("gloo", which they pick for a CPU
job) under `rankwise run` (issue 47): the checks are on with no code change, the weights
are torchrun + gloo's bit for bit, and one extra all_reduce on one rank is a
CollectiveMismatch naming the user's file:line on every rank within 10 s. Skipped where
the framework is not installed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from _autoload import autoload_env
from _procs import free_port, run
from launch_scripts.helpers import SCRIPTS, TORCH_EXIT_ABORT, launcher_cmd, torch_ok
from test_diagnosis_programs import line_of

pytestmark = [pytest.mark.procs, pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("torch.distributed")

SCRIPT = str(SCRIPTS / "framework_plain.py")


def _skip_without(framework: str) -> None:
    pytest.importorskip({"accelerate": "accelerate", "lightning": "lightning.pytorch"}[framework])


def _weights(out: Path, world: int) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(("framework", "world"), [("accelerate", 2), ("lightning", 2),
                                                  ("accelerate", 4)])
def test_a_framework_ends_with_torchruns_bits(tmp_path: Path, framework: str,
                                              world: int) -> None:
    _skip_without(framework)
    ours, theirs = tmp_path / "rankwise", tmp_path / "torchrun"
    ours.mkdir()
    theirs.mkdir()
    res = run(launcher_cmd("--no-live", "-n", str(world), SCRIPT, framework, str(ours)),
              env=autoload_env(tmp_path), timeout=400)
    assert torch_ok(res.returncode, res.stderr), res.stdout + res.stderr
    ref = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), SCRIPT, framework, str(theirs)],
              env=autoload_env(tmp_path), timeout=400)
    # torchrun exits 1 when torch's gloo aborts a rank at interpreter exit (helpers.torch_ok)
    assert ref.returncode == 0 or TORCH_EXIT_ABORT in ref.stderr, ref.stdout + ref.stderr
    mine, gloo = _weights(ours, world), _weights(theirs, world)
    assert [r["backend"] for r in mine] == ["rankwise"] * world
    assert [r["backend"] for r in gloo] == ["gloo"] * world
    assert [r["weights"] for r in mine] == [r["weights"] for r in gloo]


@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_an_extra_call_names_the_users_line_on_every_rank(tmp_path: Path,
                                                          framework: str) -> None:
    _skip_without(framework)
    res = run(launcher_cmd("--no-live", "-n", "2", SCRIPT, framework, str(tmp_path), "extra"),
              env=autoload_env(tmp_path), timeout=300)
    ended = time.time()
    assert res.returncode == 1, res.stdout + res.stderr
    extra = f"framework_plain.py:{line_of('framework-extra', SCRIPT)} in "  # the line is cut
    for rank in (0, 1):
        line = next(x for x in res.stderr.splitlines() if x.startswith(f"[rank{rank}]: "))
        assert "CollectiveMismatch" in line and extra in line, line
    took = ended - float((tmp_path / "extra_at").read_text())
    assert took < 10, f"{took:.1f} s from the extra call to the launcher's exit"
