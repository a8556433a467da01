"""Cluster environment detection (env://) and the exact environment each worker gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_scripts.helpers import JOB, run_launcher

from rankwise.errors import RendezvousError
from rankwise.launch.env import ClusterEnv, detect_env, first_slurm_host, require_env


def test_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    assert detect_env(env) == ClusterEnv(3, 4, 1, "h", 9, "torchrun")
    assert detect_env({**env, "RANKWISE_LAUNCHED": "1"}).source == "rankwise"  # type: ignore[union-attr]


def test_torchrun_wins_over_slurm() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect_env(env).source == "torchrun"  # type: ignore[union-attr]


def test_slurm_master_from_nodelist_and_port_from_job_id() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "123456"}
    assert detect_env(env) == ClusterEnv(5, 8, 1, "gpu07", 20000 + 123456 % 10000, "slurm")
    assert detect_env({**env, "MASTER_ADDR": "m", "MASTER_PORT": "7"}) == \
        ClusterEnv(5, 8, 1, "m", 7, "slurm")


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node1", "node1"), ("a,b", "a"), ("n[3-5]", "n3"), ("n[010,2]x,y", "n010x"), ("h-[1-2]", "h-1"),
])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_openmpi_and_pmi() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert detect_env(ompi) == ClusterEnv(2, 3, 0, None, None, "openmpi")
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "x"}
    assert detect_env(pmi) == ClusterEnv(1, 2, 1, "x", None, "pmi")


def test_nothing_and_incomplete() -> None:
    assert detect_env({}) is None
    with pytest.raises(RendezvousError, match="RANK, WORLD_SIZE"):
        require_env({})
    with pytest.raises(RendezvousError, match="WORLD_SIZE is not set"):
        detect_env({"RANK": "0"})
    with pytest.raises(RendezvousError, match="rank must be in"):
        detect_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(RendezvousError, match="not an integer"):
        detect_env({"RANK": "x", "WORLD_SIZE": "4"})


@pytest.mark.slow
@pytest.mark.procs
def test_worker_environment_like_torchrun(tmp_path: Path) -> None:
    res = run_launcher("-n", "2", "--rdzv-id", "job7", "--max-restarts", "2", "--no-prefix",
                       JOB, "--out", str(tmp_path), timeout=30)
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"env_{r}_0.json").read_text()) for r in range(2)]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] != "29500"
    for r, e in enumerate(envs):
        expected = {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(r), "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0", "RANKWISE_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "RANKWISE_AGENT_STORE": "1",
            "RANKWISE_LAUNCHED": "1", "OMP_NUM_THREADS": "1",
        }
        assert {k: e.get(k) for k in expected} == expected
        assert e["RANKWISE_ERROR_FILE"] == e["TORCHELASTIC_ERROR_FILE"]
        assert e["RANKWISE_ERROR_FILE"].endswith(f"rank_{r}/error.json")
        assert len(e["RANKWISE_TOKEN"]) >= 32  # a fresh token per job, by default (issue 12)
        assert detect_env(e) == ClusterEnv(r, 2, r, "127.0.0.1", int(e["MASTER_PORT"]), "rankwise")
