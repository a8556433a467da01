"""Writes ``flight_recorder_nccl/nccl_trace_rank_<r>``: a 3-rank NCCL job's flight-recorder
dumps, built by hand in torch's format (version "2.10", the keys of
``torch.distributed.flight_recorder.components``' loader and ``Op``), pickled as
``ProcessGroupNCCL`` writes them on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``).

The story: two all_reduces complete on the default group; then rank 2 skips the third one
(it went on to a barrier in a subgroup of ranks 1 and 2, whose rank 1 never came), so ranks
0 and 1 sit in all_reduce #3 and rank 2 in the subgroup's collective #1.
Run from the repository root: ``python tests/data/make_flight_recorder_nccl.py``.
"""

import os
import pickle

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flight_recorder_nccl")
T0 = 1_795_000_000_000_000_000
DEFAULT = ("0", "default_pg")
SUB = ("1", "sub:1,2")


def frames(line: int, fn: str) -> list[dict[str, object]]:
    return [{"name": fn, "filename": "/usr/lib/python3/torch/distributed/distributed_c10d.py",
             "line": 3245},
            {"name": "train_step", "filename": "/job/train.py", "line": line},
            {"name": "<module>", "filename": "/job/train.py", "line": 90}]


def entry(record: int, pg: tuple[str, str], pg_id: int, seq: int, op: str, state: str,
          line: int, size: int = 1024) -> dict[str, object]:
    done = state == "completed"
    return {"frames": frames(line, op), "record_id": record, "pg_id": pg_id,
            "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"nccl:{op}", "time_created_ns": T0 + record * 1_000_000,
            "input_sizes": [[size]], "input_dtypes": ["Float"], "output_sizes": [[size]],
            "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": T0 + record * 1_000_000 + 1000,
            "time_discovered_completed_ns": T0 + record * 1_000_000 + 5000 if done else None,
            "retired": done, "timeout_ms": 600000, "is_p2p": False, "duration_ms": 0.5}


def dump(rank: int) -> dict[str, object]:
    entries = [entry(0, DEFAULT, 0, 1, "all_reduce", "completed", 40),
               entry(1, DEFAULT, 0, 2, "all_reduce", "completed", 40)]
    if rank in (0, 1):
        entries.append(entry(2, DEFAULT, 0, 3, "all_reduce", "started", 40))
    else:
        entries.append(entry(2, SUB, 1, 1, "barrier", "scheduled", 57, size=1))
    return {"version": "2.10", "comm_lib_version": "2.27.5",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"},
                          "1": {"name": "1", "desc": "sub:1,2", "ranks": "[1, 2]"}},
            "pg_status": {"0": {"last_enqueued_collective": 3 if rank < 2 else 2,
                                "last_started_collective": 3 if rank < 2 else 2,
                                "last_completed_collective": 2}},
            "nccl_comm_state": {}, "entries": entries}


if __name__ == "__main__":
    os.makedirs(HERE, exist_ok=True)
    for r in range(3):
        with open(os.path.join(HERE, f"nccl_trace_rank_{r}"), "wb") as fh:
            pickle.dump(dump(r), fh)
