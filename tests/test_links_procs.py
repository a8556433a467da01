"""Connections opened on demand, in real processes under the launcher.

A job connects only the ranks that talk (plus, for heartbeats, ring neighbours), leaves
cleanly with no false failure, and a rank that dies before anyone connected to it is
still named on every rank waiting for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _procs
import pytest
from launch_scripts.helpers import SCRIPTS, env, launcher_cmd

pytestmark = pytest.mark.procs

WORKER = str(SCRIPTS / "lazy_worker.py")


def _run(tmp_path: Path, mode: str, extra: dict[str, str]) -> tuple[Any, dict[int, Any]]:
    e = env()
    e.update(RANKWISE_CONNECT="lazy", LAZY_MODE=mode, LAZY_OUT=str(tmp_path), **extra)
    res = _procs.run(launcher_cmd("-n", "4", WORKER), env=e, timeout=90)
    out = {int(p.stem.split("_")[1]): json.loads(p.read_text())
           for p in tmp_path.glob("result_*.json")}
    return res, out


def test_ranks_connect_only_to_the_peers_they_talk_to(tmp_path: Path) -> None:
    res, out = _run(tmp_path, "pairs", {})
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    assert sorted(out) == [0, 1, 2, 3], log
    assert out[0]["got"] == 1.0 and out[1]["got"] == 0.0
    ring = {0: {1, 3}, 1: {0, 2}, 2: {1, 3}, 3: {0, 2}}  # heartbeats: successor/predecessor
    for rank, rec in out.items():
        assert set(rec["connected"]) <= ring[rank], (rank, rec)
    assert 1 in out[0]["connected"] and 0 in out[1]["connected"]


def test_a_rank_that_dies_before_anyone_connected_is_named(tmp_path: Path) -> None:
    # no heartbeats: nothing connects to rank 2 before it exits
    res, out = _run(tmp_path, "early_death", {"RANKWISE_HEARTBEAT_TIMEOUT": "0"})
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode != 0, log
    assert sorted(out) == [0, 1, 3], log
    for rank, rec in out.items():
        assert rec["raised"] == "PeerFailure" and rec["rank"] == 2, (rank, rec, log)
        assert "rank 2" in rec["message"]
