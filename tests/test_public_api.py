"""The public surface: a curated ``__all__`` that resolves, matches torch.distributed's
core names, and keeps ``import rankwise`` free of torch (an optional dependency)."""

from __future__ import annotations

import sys

import _procs
import pytest

import rankwise

TORCH_DISTRIBUTED_NAMES = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available",
    "get_rank", "get_world_size", "get_backend", "new_group", "ReduceOp", "GroupMember",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
    "broadcast", "scatter", "reduce", "all_reduce", "gather", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "get_process_group_ranks", "get_global_rank", "get_group_rank",
    "TCPStore", "FileStore", "PrefixStore", "HashStore", "Store", "Backend", "group", "Work",
]


def test_every_exported_name_resolves() -> None:
    for name in rankwise.__all__:
        assert getattr(rankwise, name) is not None, name
    assert len(set(rankwise.__all__)) == len(rankwise.__all__), "duplicates in __all__"
    assert sorted(rankwise.__all__) == list(rankwise.__all__), "keep __all__ sorted"


def test_torch_distributed_core_names_are_there() -> None:
    missing = [n for n in TORCH_DISTRIBUTED_NAMES if n not in rankwise.__all__]
    assert not missing, f"torch.distributed names missing from rankwise: {missing}"


def test_errors_form_one_tree() -> None:
    for name in ("DistTimeout", "PeerFailure", "CollectiveMismatch", "DeadlockError",
                 "DistNetworkError",
                 "RendezvousError", "StoreError", "AuthError", "InvalidArgument"):
        assert issubclass(getattr(rankwise, name), rankwise.DistError), name
    assert issubclass(rankwise.InvalidArgument, ValueError)
    assert issubclass(rankwise.AuthError, rankwise.StoreError)


@pytest.mark.procs
def test_import_does_not_pull_in_torch() -> None:
    code = "import sys, rankwise, rankwise.store, rankwise.cli; print('torch' in sys.modules)"
    out = _procs.run([sys.executable, "-c", code], timeout=60, check=True, cwd=None)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_record_comm_labels_nest_and_stay_per_thread() -> None:
    import threading

    import pytest

    from rankwise.identity.calls import COMM_LABEL

    seen: list[str | None] = []
    with rankwise.record_comm("outer"):
        with rankwise.record_comm("inner"):
            assert COMM_LABEL.get() == "inner"
            worker = threading.Thread(target=lambda: seen.append(COMM_LABEL.get()))
            worker.start()
            worker.join()
        assert COMM_LABEL.get() == "outer"
    assert COMM_LABEL.get() is None and seen == [None]  # a new thread starts unlabelled
    with pytest.raises(rankwise.InvalidArgument, match="name"), \
            rankwise.record_comm(7):  # type: ignore[arg-type]
        pass
    assert COMM_LABEL.get() is None
