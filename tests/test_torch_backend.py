"""rankwise as a torch.distributed backend: programs written against ``torch.distributed``
(``tests/launch_scripts/torch_programs.py``) run under ``rankwise run`` (and torchrun) on
backend ``"rankwise"``, and give the same results as on torch's gloo."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from launch_scripts.helpers import ROOT, SCRIPTS, env, free_port, run_bounded, run_launcher
from test_diagnosis_programs import line_of

pytestmark = pytest.mark.procs

PROGRAM = str(SCRIPTS / "torch_programs.py")
TIMEOUT = 240.0  #: hard bound per job; the loaded 2-core machine needs the margin


def _run(case: str, backend: str, out: Path | None = None, ok: bool = True) -> str:
    # "gloo" is the reference: torch's gloo as asked, not taken over (--checks)
    checks = ["--checks=off"] if backend == "gloo" else []
    args = [*checks, "-n", "2", PROGRAM, case, backend] + ([str(out)] if out else [])
    proc = run_launcher(*args, timeout=TIMEOUT)
    text = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"exit {proc.returncode}\n{text[-6000:]}"
    return text


def _states(out: Path, tag: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{tag}-{r}.pt") for r in range(2)]


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        assert torch.equal(value, b[k]), f"{what}: {k} differs: {value} vs {b[k]}"


def test_ddp_with_sync_batchnorm_matches_gloo(tmp_path: Path) -> None:
    """torch's DDP + SyncBatchNorm: parameters and running stats identical on every rank,
    and bit-identical to the same program on gloo."""
    _run("ddp_sbn", "rankwise", tmp_path)
    _run("ddp_sbn", "gloo", tmp_path)  # gloo under rankwise run: env:// is wrapped for it
    mine, gloo = _states(tmp_path, "rankwise-sbn"), _states(tmp_path, "gloo-sbn")
    _assert_equal(mine[0], mine[1], "rank 0 vs rank 1")
    _assert_equal(mine[0], gloo[0], "rankwise vs gloo")
    assert int(mine[0]["1.num_batches_tracked"]) == 5


def test_plain_batchnorm_running_stats_differ_per_rank(tmp_path: Path) -> None:
    """The control of the test above: without the sync, each rank's running stats follow its
    own data, so equal stats there mean the sync happened."""
    _run("ddp_bn", "rankwise", tmp_path)
    bn = _states(tmp_path, "rankwise-bn")
    assert not torch.equal(bn[0]["1.running_mean"], bn[1]["1.running_mean"])
    _assert_equal({k: v for k, v in bn[0].items() if "running" not in k},
                  {k: v for k, v in bn[1].items() if "running" not in k}, "DDP parameters")


def test_sync_batchnorm_equals_batchnorm_of_the_whole_batch() -> None:
    out = _run("sbn_check", "rankwise")
    errors = [float(m) for m in re.findall(r"sbn-check rank \d max error (\S+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-5, out


def test_distributed_sampler_and_checkpoint(tmp_path: Path) -> None:
    out = _run("sampler_dcp", "rankwise", tmp_path)
    every = str(list(range(10)))
    for r in range(2):
        assert f"sampler rank {r} 5 {every}" in out, out  # no arguments: world from torch
    assert "dcp rank 0 model True own [7.0, 7.0]" in out, out
    assert "dcp rank 1 model True own [8.0, 8.0]" in out, out
    assert (tmp_path / "ckpt" / ".metadata").exists()


def _mismatch_message(case: str) -> str:
    out = _run(case, "rankwise", ok=False)
    # the launcher's summary has the root cause's whole message (each rank's own line is
    # cut). The root cause is the first rank to fail: the one whose own call found the
    # mismatch, or under DDP rank 0 whose backward raises it inside torch's RuntimeError
    # (the reducer, in C++, wraps what it raised: ``_work.fail_future``)
    found = re.search(r"exception  : (?:RuntimeError: Cannot extract tensors from value: )?"
                      r"CollectiveMismatch: .*", out)
    assert found is not None, out[-8000:]
    message = found.group(0)
    assert "distributed_c10d" not in message and "c10d_logger" not in message
    assert "autograd" not in message and "_tensor.py" not in message
    return message


@pytest.mark.parametrize(("case", "markers"), [
    ("mismatch", ("torch-mismatch-0", "torch-mismatch-1")),
    ("ddp_mismatch", ("torch-ddp-extra", "torch-ddp-backward")),
])
def test_mismatch_names_the_programs_own_lines(case: str, markers: tuple[str, str]) -> None:
    message = _mismatch_message(case)
    for marker in markers:
        assert f"torch_programs.py:{line_of(marker, PROGRAM)} in " in message, message


def test_peer_failure_reaches_the_waiting_rank() -> None:
    out = _run("peer_failure", "rankwise", ok=False)
    assert "PeerFailure: rank 1 failed: RuntimeError: rank 1 gives up" in out, out
    assert f"torch_programs.py:{line_of('torch-peer-wait', PROGRAM)} in peer_failure" in out


def test_under_torchrun() -> None:
    """torchrun's own store: rankwise's rendezvous runs on it (no second port)."""
    e = env()
    e.pop("RANKWISE_LAUNCHED", None)
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), PROGRAM, "sbn_check", "rankwise"],
                       e, TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert len(re.findall(r"sbn-check rank \d max error", proc.stdout)) == 2, proc.stdout


def test_overhead_benchmark_runs() -> None:
    """benchmarks/torch_backend.py (a short run: the ratio itself is measured quietly)."""
    proc = run_bounded([sys.executable, str(ROOT / "benchmarks" / "torch_backend.py"),
                        "--iters", "50", "--blocks", "2"], env(), TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    row = proc.stdout.strip().splitlines()[-1].split()
    assert row[0] == "2" and float(row[3]) > 0, proc.stdout
