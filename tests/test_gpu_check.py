"""Issue 28: ``scripts/gpu-check`` without a GPU, and its step runner with stand-in steps.

On this machine there is no CUDA device: the script must say so in one line and exit
with its own code (3) before running anything; ``--dry-run`` must list every step and
write the summary; and the runner must record a failing, an overrunning and a skipped
step without stopping, and always write the summary text and JSON.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _procs import run

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
STEPS = ["versions", "no-host-sync", "ddp-nccl-1", "ddp-staged-2", "mismatch", "killed",
         "pytest-cuda", "bench", "host-time", "torch-stack", "fsdp-mismatch", "torch-suite"]


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    loader.exec_module(module)
    return module


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_FORCE")}
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi
    return run([sys.executable, str(SCRIPT), *args], timeout=120, env=env, cwd=tmp)


def test_no_gpu_exits_at_once_with_its_line_and_code(tmp_path: Path) -> None:
    if any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has a GPU")
    out = _run("--out", str(tmp_path / "out"), tmp=tmp_path)
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stdout.startswith("gpu-check: no CUDA device (") and \
        out.stdout.count("\n") == 1, out.stdout
    assert not (tmp_path / "out").exists(), "nothing may run without a GPU"
    assert os.access(SCRIPT, os.X_OK), "scripts/gpu-check must be executable"


def test_dry_run_lists_every_step_and_writes_the_summary(tmp_path: Path) -> None:
    out = _run("--dry-run", "--out", str(tmp_path), tmp=tmp_path)
    assert out.returncode == 0, out.stderr
    for name in STEPS:
        assert name in out.stdout
    data = json.loads((tmp_path / "gpu-check-summary.json").read_text())
    assert [s["name"] for s in data["steps"]] == STEPS
    text = (tmp_path / "gpu-check-summary.txt").read_text()
    assert text.startswith("rankwise gpu-check")
    assert "result: dry run, nothing run" in text and "passed" not in text, text
    assert data["dry_run"] is True


def test_an_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    out = _run("--only", "nope", tmp=tmp_path)
    assert out.returncode == 2 and "unknown steps ['nope']" in out.stderr


def test_failures_and_overruns_are_recorded_and_the_summary_always_written(
        tmp_path: Path) -> None:
    gc = _load()
    py = sys.executable
    steps = [
        gc.Step("good", "passes", [py, "-c", "print('RESULT: PASS: fine')"], 30,
                expect="RESULT: PASS"),
        gc.Step("bad", "exits 1", [py, "-c", "import sys; print('boom'); sys.exit(1)"], 30),
        gc.Step("silent", "exits 0 without its line", [py, "-c", "pass"], 30,
                expect="RESULT: PASS"),
        gc.Step("slow", "overruns its bound", [py, "-c", "import time; time.sleep(120)"], 2),
        gc.Step("later", "not there yet", [], 0, skip="not available yet"),
    ]
    outcomes = gc.run_all(steps, budget=300, out_dir=tmp_path, echo=False)
    assert [o.status for o in outcomes] == ["pass", "fail", "fail", "timeout", "skipped"]
    assert outcomes[1].tail == ["boom"] and outcomes[3].verdict.startswith("killed after 2s")
    text = gc.summary(outcomes, tmp_path, "now", 1.0)
    assert "result: FAILED: bad, silent, slow (1 passed, 1 skipped)" in text
    assert "| boom" in text
    data = json.loads((tmp_path / "gpu-check-summary.json").read_text())
    assert data["failed"] == ["bad", "silent", "slow"]


def test_the_budget_bounds_every_step(tmp_path: Path) -> None:
    gc = _load()
    step = gc.Step("late", "no time left", [sys.executable, "-c", "pass"], 30)
    (outcome,) = gc.run_all([step], budget=gc.RESERVE, out_dir=tmp_path, echo=False)
    assert outcome.status == "skipped" and "no time left" in outcome.verdict


def test_the_torch_suite_step_runs_only_a_suite_with_the_cuda_switch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc = _load()
    monkeypatch.setattr(gc, "ROOT", tmp_path)
    assert gc.torch_suite_step().skip.startswith("not available yet: no tests/torch_suite/")
    suite = tmp_path / "tests" / "torch_suite"
    suite.mkdir(parents=True)
    (suite / "test_suite.py").write_text("BACKEND = 'rankwise'\n")
    assert "has no CUDA switch" in gc.torch_suite_step().skip
    (suite / "test_suite.py").write_text("DEVICE = os.environ.get("
                                         "'RANKWISE_TORCH_SUITE_DEVICE')\n")
    step = gc.torch_suite_step()
    assert step.skip is None and step.env == {"RANKWISE_TORCH_SUITE_DEVICE": "cuda"}
    assert step.argv[-1] == str(suite)


def test_the_vendored_expecttest_wheel_is_on_the_steps_path() -> None:
    gc = _load()
    path = gc.env()["PYTHONPATH"].split(os.pathsep)
    wheels = [p for p in path if p.endswith(".whl")]
    assert wheels and all(Path(w).stat().st_size < 64 * 1024 for w in wheels)
    out = run([sys.executable, "-c", "import expecttest"], timeout=60,
              env={"PYTHONPATH": os.pathsep.join(wheels), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def _pytest_step(gc: ModuleType, name: str, body: str, tmp: Path) -> Any:
    """A pytest step over one file holding ``body``."""
    test = tmp / f"test_{name}.py"
    test.write_text("import pytest\n" + body)
    return gc.Step(name, name, [sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                                "no:cacheprovider", str(test)], 60, pytest=True)


def test_a_step_that_runs_no_test_is_skipped_with_its_reason_never_passed(
        tmp_path: Path) -> None:
    """Issue 34: the torch-suite step ran 0 tests (all skipped) and reported PASS."""
    gc = _load()
    py = sys.executable
    steps = [
        _pytest_step(gc, "all_skipped", "@pytest.mark.skip(reason='needs 2 GPUs')\n"
                     "def test_a(): pass\n", tmp_path),
        _pytest_step(gc, "none_collected", "X = 1\n", tmp_path),
        _pytest_step(gc, "one_ran", "def test_a(): pass\n"
                     "@pytest.mark.skip(reason='later')\ndef test_b(): pass\n", tmp_path),
        gc.Step("says_skip", "a program that cannot run here", [
            py, "-c", "print('RESULT: SKIP: needs NCCL')"], 30, expect="RESULT: PASS"),
    ]
    outcomes = gc.run_all(steps, budget=300, out_dir=tmp_path, echo=False)
    assert [o.status for o in outcomes] == ["skipped", "skipped", "pass", "skipped"], \
        [(o.status, o.verdict) for o in outcomes]
    assert outcomes[0].verdict.startswith("ran 0 tests (1 skipped") and \
        "needs 2 GPUs" in outcomes[0].verdict, outcomes[0].verdict
    assert outcomes[1].verdict.startswith("ran 0 tests"), outcomes[1].verdict
    assert outcomes[3].verdict == "needs NCCL"
    text = gc.summary(outcomes, tmp_path, "now", 1.0)
    assert "result: all passed (1 passed, 3 skipped)" in text, text
    text = gc.summary(outcomes[:2], tmp_path, "now", 1.0)
    assert "result: nothing passed (0 passed, 2 skipped)" in text, text


def test_pytest_counts_reads_the_closing_line() -> None:
    gc = _load()
    assert gc.pytest_counts(["x", "10 skipped, 1863 deselected, 67 warnings in 5.45s"]) == \
        {"skipped": 10, "deselected": 1863, "warnings": 67}
    assert gc.pytest_counts(["==== 2 passed, 1 error in 0.1s ===="]) == \
        {"passed": 2, "errors": 1}
    assert gc.pytest_counts(["no tests ran in 0.01s"]) == {}
    assert gc.pytest_counts(["Traceback", "ImportError: x"]) is None
