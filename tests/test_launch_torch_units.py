"""Plain torch scripts under `rankwise run` (issue 36), in-process: the workers' variables,
torch's @record error files in the summary, and torch's store kept apart from rankwise's."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest

from rankwise.cli import parse_run_args  # at collection: it finds libc's prctl (ldconfig)
from rankwise.launch.env import WorkerEnvSpec, worker_environment
from rankwise.launch.summary import WorkerOutcome, format_summary, read_error_file, root_cause


def test_workers_get_torchruns_variables() -> None:
    spec = WorkerEnvSpec(rank=1, local_rank=1, world_size=4, local_world_size=2, node_rank=0,
                         nnodes=2, master_addr="10.0.0.1", master_port=29500, restart_count=1,
                         max_restarts=3, run_id="job7", error_file="/e/error.json",
                         role="trainer")
    env = worker_environment(spec, {})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "3")
    assert (env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_ERROR_FILE"]) == ("job7", "/e/error.json")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "2", "2")
    assert (env["ROLE_NAME"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("trainer", "1", "4")
    assert env["OMP_NUM_THREADS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    mine = worker_environment(spec, {"OMP_NUM_THREADS": "4"})
    assert mine["OMP_NUM_THREADS"] == "4"  # the user's value wins, as under torchrun


def _torch_record(path: Path, text: str, stack: str) -> str:
    path.write_text(json.dumps({"message": {"message": text, "extraInfo": {
        "py_callstack": stack, "timestamp": "1700000000"}}}))
    return str(path)


def test_torch_record_files_name_the_rank_that_raised_first(tmp_path: Path) -> None:
    raised = _torch_record(tmp_path / "a.json", "ValueError: bad batch on rank 1",
                           "Traceback (most recent call last):\n  File \"train.py\", line 9\n"
                           "ValueError: bad batch on rank 1\n")
    # written later, but within the same second: torch's own timestamp cannot order them
    victim = _torch_record(tmp_path / "b.json", "RuntimeError: [pair.cc:553] Connection "
                           "closed by peer [127.0.0.1]:1", "Traceback ...")
    os.utime(victim, (1700000000.9, 1700000000.9))
    os.utime(raised, (1700000000.5, 1700000000.5))
    outcomes = [WorkerOutcome(rank=r, local_rank=r, node_rank=0, pid=10 + r, returncode=1,
                              observed_at=1700000001.0, error_file=f, error=read_error_file(f))
                for r, f in ((0, victim), (1, raised))]
    assert outcomes[0].secondary and not outcomes[1].secondary
    assert root_cause(outcomes) is outcomes[1]
    text = format_summary(outcomes)
    assert "rank       : 1" in text and "exception  : ValueError: bad batch on rank 1" in text
    assert 'File "train.py", line 9' in text, text


@pytest.mark.torch
def test_a_stranger_speaking_torchs_protocol_cannot_reach_rankwises_keys() -> None:
    """torch's client on the store port is served by torch's own store, a separate
    server: it sees and changes torch's keys only, never the keys behind the token."""
    import torch.distributed as tdist

    from rankwise.errors import AuthError, DistError
    from rankwise.launch.torch_store import TorchStoreHost
    from rankwise.store import TCPStore, TCPStoreServer

    said: list[str] = []
    host = TorchStoreHost(said.append)
    with TCPStoreServer("127.0.0.1", 0, token="job-secret", on_torch_client=host.take) as server:
        owner = TCPStore("127.0.0.1", server.port, is_master=False, token="job-secret",
                         timeout=timedelta(seconds=5))
        owner.set("rankwise/0/secret", "42")
        try:
            stranger = tdist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                timeout=timedelta(seconds=20))
            assert not stranger.check(["rankwise/0/secret"])
            stranger.set("rankwise/0/secret", "forged")
            assert stranger.get("rankwise/0/secret") == b"forged"
            assert owner.get("rankwise/0/secret") == b"42"
            with pytest.raises((AuthError, DistError)):
                TCPStore("127.0.0.1", server.port, is_master=False, token=None,
                         timeout=timedelta(seconds=3)).get("rankwise/0/secret")
            host.begin_attempt(1)  # a restart: a fresh torch store, the old keys gone
            fresh = tdist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                timeout=timedelta(seconds=20))
            assert not fresh.check(["rankwise/0/secret"])
        finally:
            owner.close()
            host.close()
    assert len(said) == 1 and "not rankwise's per-call checks" in said[0]


def test_torchruns_options_are_accepted_or_refused_before_any_io() -> None:
    opts = parse_run_args(["--standalone", "--rdzv-backend", "static", "--role", "trainer",
                           "--local_ranks_filter", "0,2", "--monitor-interval", "5",
                           "--start-method", "fork", "-r", "3", "--log-dir", "d", "x.py"])
    assert (opts.role, opts.console_ranks, opts.tee) == ("trainer", frozenset({0, 2}), False)
    for bad in (["--rdzv-backend", "etcd"], ["--local-ranks-filter", "a,b"],
                ["--standalone", "--nnodes", "2", "--master-port", "29500"]):
        with pytest.raises(SystemExit):
            parse_run_args([*bad, "x.py"])
