"""benchmarks/torch_programs.py, in process: its options refused before any process starts,
the jobs it makes of the programs, the rank files it reads, and its table (the ratios are
measured on a quiet machine, not asserted here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _procs import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import torch_programs as bench


@pytest.mark.parametrize("argv, says", [
    (["--programs", "ddp_tutorial,ddp"], "--programs: unknown ddp"),
    (["--programs", ","], "--programs: unknown (none given)"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--ranks", "1"], "--ranks must be at least 2"),
    (["--steps", "2"], "--steps must be at least 3"),
    (["--warmup", "0"], "--warmup must be at least 1"),
])
def test_bad_options_say_what_is_wrong(argv: list[str], says: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert says in capsys.readouterr().err


def test_a_framework_that_is_missing_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "_installed", lambda module: module != "accelerate")
    assert "accelerate" not in bench.available() and "lightning" in bench.available()
    with pytest.raises(SystemExit):
        bench.parse_args(["--programs", "fsdp2,accelerate"])
    assert "--programs: accelerate not installed" in capsys.readouterr().err


def test_the_stack_runs_in_one_job_and_each_framework_alone() -> None:
    args = bench.parse_args(["--programs", "lightning,fsdp2, ddp_tutorial,accelerate"])
    assert args.programs == ["lightning", "fsdp2", "ddp_tutorial", "accelerate"]
    assert bench.jobs(args.programs) == [["fsdp2", "ddp_tutorial"], ["lightning"],
                                         ["accelerate"]]
    rw = bench.command("rankwise", 2, Path("o"), 5, 30, ["fsdp2"])
    assert rw[1:7] == ["-m", "rankwise", "run", "--no-live", "-n", "2"], rw
    assert rw[-4:] == ["o", "5", "30", "fsdp2"] and rw[-5].endswith("_worker.py"), rw
    tr = bench.command("gloo", 4, Path("o"), 5, 30, ["fsdp2"])
    assert tr[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "4"], tr
    off = bench.command("off", 2, Path("o"), 5, 30, ["fsdp2"])
    assert off[1:8] == ["-m", "rankwise", "run", "--no-live", "--checks=off", "-n", "2"], off
    assert args.launchers == ("rankwise", "gloo")
    assert bench.parse_args(["--off"]).launchers == ("rankwise", "gloo", "off")


def _rank_files(out: Path, name: str, backend: str, steps: list[list[float]]) -> None:
    for rank, times in enumerate(steps):
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(
            {"backend": backend, "step_s": times, "cpu_s": [t / 2 for t in times]}))


def test_a_job_counts_its_slowest_ranks_median_step(tmp_path: Path) -> None:
    _rank_files(tmp_path, "fsdp2", "rankwise", [[0.1, 0.3, 0.2], [0.4, 0.5, 9.0]])
    assert bench.read_job(tmp_path, ["fsdp2"], 2, "rankwise") == \
        {"fsdp2": {"wall": 0.5, "cpu": 0.25}}
    with pytest.raises(SystemExit, match="ran on backend 'rankwise', not 'gloo'"):
        bench.read_job(tmp_path, ["fsdp2"], 2, "gloo")
    with pytest.raises(SystemExit, match="ddp_tutorial wrote no ddp_tutorial-rank0.json"):
        bench.read_job(tmp_path, ["ddp_tutorial"], 2, "rankwise")
    _rank_files(tmp_path, "pipelining", "gloo", [[0.1], [0.1]])
    with pytest.raises(SystemExit, match="entry point"):
        bench.read_job(tmp_path, ["pipelining"], 2, "rankwise")
    assert bench.read_job(tmp_path, ["pipelining"], 2, "off") == \
        {"pipelining": {"wall": 0.1, "cpu": 0.05}}  # --checks=off: torch's gloo, as asked


def test_the_table_gives_each_ratio_over_repeats_and_one_summary_line() -> None:
    lines = bench.table({"fsdp2": {"rankwise": [0.012, 0.010, 0.033],
                                   "gloo": [0.010, 0.010, 0.010]},
                         "pipelining": {"rankwise": [0.009, 0.010, 0.011],
                                        "gloo": [0.010, 0.010, 0.010]}}, "wall")
    assert lines[0].split()[:2] == ["wall", "clock"], lines
    assert lines[1].split() == ["fsdp2", "12.00", "10.00", "1.20", "1.00-3.30"], lines
    assert lines[2].split() == ["pipelining", "10.00", "10.00", "1.00", "0.90-1.10"], lines
    assert lines[-1] == ("torch programs step time, rankwise run (checks on) / torchrun + "
                         "gloo: median 1.10x, worst fsdp2 1.20x; 1 of 2 at or under 1.1x "
                         "(over: fsdp2)")


def test_the_checks_alone_are_rankwise_against_its_launcher_without_them() -> None:
    lines = bench.table({"fsdp2": {"rankwise": [0.02], "gloo": [0.01], "off": [0.016]}},
                        "cpu", "rankwise", "off")
    assert lines[0].split()[:4] == ["cpu", "clock", "rankwise", "ms"], lines
    assert lines[1].split()[:4] == ["fsdp2", "20.00", "16.00", "1.25"], lines
    assert lines[-1].startswith("torch programs step CPU time, rankwise run (checks on) / "
                                "rankwise run --checks=off: median 1.25x"), lines


def test_pin_reaches_the_ranks_of_either_launcher_alike() -> None:
    assert bench.parse_args(["--pin"]).pin and not bench.parse_args([]).pin
    assert bench._environ(pin=True)["TORCH_PROGRAMS_PIN"] == "1"
    assert bench._environ()["TORCH_PROGRAMS_PIN"] == "0"  # an outer setting never leaks in
