"""torch's own clients on backend ``"rankwise"`` against ``"gloo"`` (issue 35): FSDP1,
FSDP2, tensor parallel, distributed checkpoint, pipelining (GPipe, 1F1B), DDP with a comm
hook, ``no_sync`` and ``Join``, and the backend corners they lean on. Final parameters
must be bit-identical to gloo's.

All of it is one job of 2 ranks (``_torch_client_workloads.run_all``), run once per module
(a spawn of torch ranks costs seconds on the 2-core CI machine); each test reads its part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import _torch_client_workloads as workloads
from test_ddp_harness import free_port, run_ranks

pytestmark = [pytest.mark.procs, pytest.mark.torch, pytest.mark.slow]

WORLD = 2


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("clients")


@pytest.fixture(scope="module")
def results(root: Path) -> list[dict[str, Any]]:
    return run_ranks(workloads.run_all, WORLD, free_port(), str(root), backend="rankwise",
                     timeout=200)


def _same_as_gloo(results: list[dict[str, Any]], name: str) -> list[Any]:
    """The workload's per-rank value on rankwise, after checking it equals gloo's."""
    mine = []
    for rank, got in enumerate(results):
        entry = got[name]
        assert not str(entry["gloo"]).startswith("raised"), f"{name} on gloo: {entry['gloo']}"
        assert entry["rankwise"] == entry["gloo"], (
            f"{name} on rank {rank}: rankwise {str(entry['rankwise'])[:3000]}\n"
            f"gloo {str(entry['gloo'])[:3000]}")
        mine.append(entry["rankwise"])
    return mine


def test_a_gathered_tensor_can_still_be_freed(results: list[dict[str, Any]]) -> None:
    """FSDP1's free (``untyped_storage().resize_(0)``) after the backend wrote the tensor:
    ``Tensor.numpy()`` used to make the storage non-resizable for good."""
    assert _same_as_gloo(results, "storage_stays_resizable")[0] == [0.0, 0.0, 1.0, 1.0]


def test_a_leaf_that_requires_grad_is_received_into(results: list[dict[str, Any]]) -> None:
    """irecv and broadcast write a leaf that requires grad, as gloo does (pipelining)."""
    got = _same_as_gloo(results, "leaf_receives")
    assert got[1] == {"recv": [1.0, 2.0, 3.0], "broadcast": [5.0, 5.0], "leaf": True}


def test_batch_isend_irecv(results: list[dict[str, Any]]) -> None:
    assert _same_as_gloo(results, "batch_p2p") == [[1.0, 1.0], [0.0, 0.0]]


def test_premul_sum_applies_the_factor(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert got["premul_sum"]["rankwise"] == [1.5, 1.5, 1.5]  # 0.5 * (1 + 2)


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2", "tensor_parallel", "ddp_hooks",
                                  "pipeline_ScheduleGPipe", "pipeline_Schedule1F1B"])
def test_training_is_bit_identical_to_gloo(results: list[dict[str, Any]], name: str) -> None:
    params = _same_as_gloo(results, name)
    if name != "pipeline_ScheduleGPipe" and name != "pipeline_Schedule1F1B":
        assert params[0] == params[1], f"{name}: ranks disagree"  # replicated in the end


def test_checkpoint_round_trip_is_bit_identical_to_gloo(results: list[dict[str, Any]]) -> None:
    for reloaded_equal, _ in _same_as_gloo(results, "checkpoint"):
        assert reloaded_equal


def test_checkpoints_of_2_ranks_load_on_4(results: list[dict[str, Any]], root: Path) -> None:
    """2 -> 4 resharding: rankwise's and gloo's 2-rank checkpoints load on 4 ranks over
    rankwise into the parameters that were saved."""
    saved = results[0]["checkpoint"]["rankwise"][1]
    loaded = run_ranks(workloads.load_resharded, 4, free_port(), str(root),
                       backend="rankwise", timeout=200)
    for rank, got in enumerate(loaded):
        assert got == {"gloo": saved, "rankwise": saved}, f"rank {rank}"


def test_ddp_reduces_beside_backward_as_gloo_does(results: list[dict[str, Any]]) -> None:
    """torch's DDP overlaps: the comm hook returns before the reduction ends, and the
    future's callback runs on the backend's worker, as on gloo (it used to run inline)."""
    assert _same_as_gloo(results, "ddp_overlap")[0] == {
        "hook_returned_first": True, "callback_off_the_backward_thread": True}


def test_barrier_honours_its_timeout(results: list[dict[str, Any]]) -> None:
    """``barrier(timeout=1s)`` with the peer 4 s late raises near 1 s (not when the peer
    comes), worded so torch's suite recognizes a timeout (" timeout ")."""
    got = results[0]["barrier_timeout"]["rankwise"]
    assert got["raised_after"] is not None, f"returned after {got['returned_after']:.1f}s"
    assert got["raised_after"] < 3.0, got
    assert " timeout " in got["message"], got["message"]
