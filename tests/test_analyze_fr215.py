"""``rankwise analyze`` on torch 2.15's flight-recorder dumps (issue 47): its recorder names
("nccl2:", "nccl-lazy:", "c10d:" where torch's hook could not name the backend, a custom
backend's own) and one recorder per backend, so one rank may leave a dump per backend and
one group's calls are numbered by each. Synthetic dumps in the format torch 2.15 writes
(``_dump_fr_trace``: version "2.10", the entry keys below), checked by no torch."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from rankwise.diagnosis.analyze import analyze
from rankwise.diagnosis.flight import load_flight_dumps


def _entry(backend: str, op: str, seq: int, sizes: list[list[int]], dtype: str = "Float",
           state: str = "completed", pg: tuple[str, str] = ("0", "default_pg")) -> dict[str, Any]:
    return {"record_id": seq, "pg_id": int(pg[0]), "process_group": pg,
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"{backend}:{op}", "time_created_ns": 1_700_000_000_000_000_000,
            "input_sizes": sizes, "input_dtypes": [dtype], "output_sizes": sizes,
            "output_dtypes": [dtype], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": state == "completed",
            "timeout_ms": 600000, "is_p2p": False, "thread_id": "1", "thread_name": "main",
            "frames": [{"name": "<module>", "filename": "train.py", "line": 10 + seq}]}


def _dump(entries: list[dict[str, Any]]) -> bytes:
    return pickle.dumps({"version": "2.10", "comm_lib_version": "", "entries": entries,
                         "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                             "ranks": "[0, 1]"}},
                         "pg_status": {}})


def test_one_recorder_per_backend_each_numbered_alone(tmp_path: Path) -> None:
    """A "cpu:gloo,cuda:nccl2" group: gloo's and nccl2's recorders both hold calls #1 and
    #2 of group 0; only nccl2's #2 disagrees, and only there is it reported."""
    for rank in range(2):
        gloo = [_entry("gloo", "all_reduce", 1, [[4]]), _entry("gloo", "barrier", 2, [[1]])]
        second = ("all_reduce", "Float") if rank == 0 else ("broadcast", "Double")
        nccl2 = [_entry("nccl2", "all_reduce", 1, [[8]]),
                 _entry("nccl2", second[0], 2, [[8]], second[1], state="scheduled")]
        (tmp_path / f"gloo-trace-{rank}").write_bytes(_dump(gloo))
        (tmp_path / f"nccl2-trace-{rank}").write_bytes(_dump(nccl2))
    dumps = load_flight_dumps(str(tmp_path))
    assert sorted(dumps) == [0, 1] and all(len(d["entries"]) == 4 for d in dumps.values())
    text = analyze(str(tmp_path))
    assert "2 of 2 ranks left a dump" in text and "gloo, nccl2 calls" in text, text
    diverged = [ln for ln in text.splitlines() if "collective #2" in ln]
    assert len(diverged) == 1, text
    assert "group default_pg [nccl2] (ranks 0, 1), collective #2" in diverged[0]
    assert "rank 0 called all_reduce" in diverged[0]
    assert "rank 1 called broadcast" in diverged[0]
    assert "train.py:12" in diverged[0]
    assert "rank 0, group default_pg [gloo]: idle after #2 barrier" in text


def test_new_recorder_names_read(tmp_path: Path) -> None:
    """"nccl-lazy:" and "c10d:" (torch's hook's fallback) are read like "nccl:": the op
    after the colon, the backend before it."""
    for rank in range(2):
        entries = [_entry("nccl-lazy", "all_gather", 1, [[2]], pg=("0", "default_pg")),
                   _entry("c10d", "all_reduce" if rank == 0 else "reduce_scatter", 2, [[2]],
                          state="scheduled")]
        (tmp_path / f"trace_{rank}").write_bytes(_dump(entries))
    text = analyze(str(tmp_path))
    assert "c10d, nccl-lazy calls" in text, text
    line = next(ln for ln in text.splitlines() if "collective #2" in ln)
    assert "rank 0 called all_reduce" in line and "rank 1 called reduce_scatter" in line
    assert "collective #1" not in text  # the all_gathers agree
