"""Local misuse fails with ``InvalidArgument`` before any I/O (issue 2, items 3, 5, 6, 9).

"Before any I/O" is checked, not assumed: init-time misuse runs against a listening
socket that must see no connection; collective/p2p misuse runs on one rank at a time
while the other waits, and afterwards both ranks' next collective and a tagged p2p
message must still line up (a misuse that had consumed a sequence number or sent a
stray frame would desynchronize them; the short group timeout keeps that bounded).
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest
from _error_cases import assert_every_rank, expect

import rankwise as dist
from rankwise.engines.select import cuda_missing
from rankwise.testing import run_ranks

# --- before init, and init arguments -----------------------------------------------------


def test_calls_before_init_say_to_init_first() -> None:
    assert not dist.is_initialized()
    a = np.ones(4, np.float32)
    problems: list[str] = []
    for name, fn in [
        ("all_reduce", lambda: dist.all_reduce(a)),
        ("barrier", lambda: dist.barrier()),
        ("broadcast", lambda: dist.broadcast(a, src=0)),
        ("send", lambda: dist.send(a, dst=1)),
        ("recv", lambda: dist.recv(a, src=1)),
        ("all_gather_object", lambda: dist.all_gather_object([None, None], 1)),
        ("new_group", lambda: dist.new_group([0])),
        ("destroy_process_group", lambda: dist.destroy_process_group()),
        ("get_backend", lambda: dist.get_backend()),
    ]:
        expect(problems, name, fn, "InvalidArgument", "not initialized", "init_process_group")
    assert not problems, "\n".join(problems)


@pytest.fixture()
def silent_listener() -> Any:
    """A listening socket that must never see a connection (proof of no I/O)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.settimeout(0.05)
    yield s
    s.close()


def _no_connection(s: socket.socket) -> None:
    try:
        conn, _ = s.accept()
    except (TimeoutError, BlockingIOError):
        return
    conn.close()
    raise AssertionError("init_process_group connected to the store before rejecting "
                         "its arguments")


def test_init_arguments_rejected_before_any_connection(silent_listener: socket.socket,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANKWISE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    port = silent_listener.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    # rank 1 would connect (not bind) if validation came after I/O: the listener sees it
    ok = {"init_method": url, "rank": 1, "world_size": 2, "timeout": 2.0}
    no_gpu = ("needs a CUDA GPU",) if cuda_missing() is not None else ()
    cases: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
        # without CUDA: "needs a CUDA GPU" and why; with it: the NCCL plane is not built
        ("nccl", {**ok, "backend": "nccl"}, ("nccl", "gloo", *no_gpu)),
        ("cuda:nccl", {**ok, "backend": "cuda:nccl"}, ("cuda:nccl", *no_gpu)),
        ("cpu:gloo,cuda:nccl", {**ok, "backend": "cpu:gloo,cuda:nccl"}, ("cuda:nccl", *no_gpu)),
        ("unknown backend", {**ok, "backend": "mpi"}, ("unknown backend", "mpi", "tcp")),
        ("backend not a str", {**ok, "backend": 3}, ("backend",)),
        ("rank out of range", {**ok, "backend": "tcp", "rank": 2}, ("rank 2", "0..1")),
        ("negative rank", {**ok, "backend": "gloo", "rank": -5}, ("rank -5",)),
        ("negative world size", {**ok, "backend": "tcp", "world_size": -3},
         ("world_size", "-3")),
        ("zero world size", {**ok, "backend": "tcp", "world_size": 0}, ("world_size",)),
        ("rank not an int", {**ok, "backend": "tcp", "rank": "1"}, ("rank", "int")),
        ("negative timeout", {**ok, "backend": "tcp", "timeout": -1.0}, ("timeout",)),
        ("bad scheme", {**ok, "backend": "tcp", "init_method": f"udp://127.0.0.1:{port}"},
         ("udp://", "env://")),
        ("tcp without port", {**ok, "backend": "tcp", "init_method": "tcp://127.0.0.1"},
         ("tcp://host:port",)),
        ("store and init_method", {**ok, "backend": "tcp", "store": object()},
         ("store=", "init_method=")),
    ]
    problems: list[str] = []
    for name, kwargs, needles in cases:
        expect(problems, name, lambda kw=kwargs: dist.init_process_group(**kw),
               "InvalidArgument", *needles)
        assert not dist.is_initialized()
        _no_connection(silent_listener)
    assert not problems, "\n".join(problems)


def test_env_init_names_the_missing_variable(silent_listener: socket.socket,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANKWISE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    port = str(silent_listener.getsockname()[1])
    problems: list[str] = []
    kw = {"backend": "tcp", "init_method": "env://", "timeout": 2.0}

    monkeypatch.setenv("MASTER_PORT", port)
    expect(problems, "no MASTER_ADDR (args)",
           lambda: dist.init_process_group(rank=1, world_size=2, **kw),
           "InvalidArgument", "MASTER_ADDR")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    expect(problems, "no MASTER_ADDR (env)", lambda: dist.init_process_group(**kw),
           "InvalidArgument", "MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    expect(problems, "no MASTER_PORT", lambda: dist.init_process_group(**kw),
           "InvalidArgument", "MASTER_PORT")
    monkeypatch.setenv("MASTER_PORT", "twelve")
    expect(problems, "MASTER_PORT not a number", lambda: dist.init_process_group(**kw),
           "InvalidArgument", "MASTER_PORT", "twelve")
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.delenv("RANK")
    expect(problems, "no RANK", lambda: dist.init_process_group(**kw),
           "InvalidArgument", "RANK")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE")
    # the launcher's environment detection names it (as RendezvousError: torchrun variables
    # present but incomplete); still local and before any I/O
    expect(problems, "no WORLD_SIZE", lambda: dist.init_process_group(**kw),
           "DistError", "WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    expect(problems, "RANK out of range", lambda: dist.init_process_group(**kw),
           "DistError", "rank", "2")
    assert not dist.is_initialized()
    _no_connection(silent_listener)
    assert not problems, "\n".join(problems)


# --- misuse inside a running 2-rank job ----------------------------------------------------


def _misuse_cases(rank: int, other: int, g_self: Any, g_other: Any,
                  torch: Any) -> list[tuple[str, Any, str, tuple[str, ...]]]:
    """(name, thunk, exception class name, message needles) for one rank of two."""
    f32 = np.arange(4, dtype=np.float32)
    i32 = np.arange(4, dtype=np.int32)
    c64 = np.ones(4, np.complex64)
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    strided = np.ones(8, np.float32)[::2]
    rows4 = np.zeros((4, 2), np.float32)
    P = dist.P2POp
    cases: list[tuple[str, Any, str, tuple[str, ...]]] = [
        ("double init", lambda: dist.init_process_group(
            "tcp", init_method="tcp://127.0.0.1:1", rank=rank, world_size=2),
         "InvalidArgument", ("already",)),
        ("send to self", lambda: dist.send(f32, dst=rank), "InvalidArgument", ("itself",)),
        ("recv from self", lambda: dist.recv(f32, src=rank), "InvalidArgument", ("itself",)),
        ("isend to self", lambda: dist.isend(f32, dst=rank), "InvalidArgument", ("itself",)),
        ("irecv from self", lambda: dist.irecv(f32, src=rank), "InvalidArgument", ("itself",)),
        ("send_object_list to self", lambda: dist.send_object_list([1], dst=rank),
         "InvalidArgument", ("itself",)),
        ("send dst out of range", lambda: dist.send(f32, dst=5), "InvalidArgument",
         ("dst=5",)),
        ("recv src negative", lambda: dist.recv(f32, src=-2), "InvalidArgument", ("src=-2",)),
        ("send dst not in group", lambda: dist.send(f32, dst=other, group=g_self),
         "InvalidArgument", (f"dst={other}", "not a member")),
        ("broadcast src not in group", lambda: dist.broadcast(f32, src=other, group=g_self),
         "InvalidArgument", (f"src={other}", "not a member")),
        ("reduce dst out of range", lambda: dist.reduce(f32, dst=9), "InvalidArgument",
         ("dst=9",)),
        ("broadcast src and group_src", lambda: dist.broadcast(f32, src=0, group_src=0),
         "InvalidArgument", ("group_src",)),
        ("broadcast group_src out of range", lambda: dist.broadcast(f32, group_src=2),
         "InvalidArgument", ("group_src=2",)),
        ("bad group", lambda: dist.all_reduce(f32, group="world"), "InvalidArgument",
         ("group",)),
        ("bad tag", lambda: dist.send(f32, dst=other, tag="x"), "InvalidArgument", ("tag",)),
        ("batch with a self-send", lambda: dist.batch_isend_irecv(
            [P(dist.isend, f32, other), P(dist.isend, f32, rank)]),
         "InvalidArgument", ("itself",)),
        ("batch not P2POps", lambda: dist.batch_isend_irecv([f32]), "InvalidArgument",
         ("P2POp",)),
        ("new_group rank out of range", lambda: dist.new_group([0, 7]), "InvalidArgument",
         ("7",)),
        ("new_group duplicate ranks", lambda: dist.new_group([0, 0]), "InvalidArgument",
         ("duplicate",)),
        # wrong list lengths
        ("all_gather list too short", lambda: dist.all_gather([f32.copy()], f32),
         "InvalidArgument", ("tensor_list", "1 tensors", "2 ranks")),
        ("gather list too long on dst", lambda: dist.gather(
            f32, [f32.copy() for _ in range(3)], dst=rank), "InvalidArgument",
         ("gather_list", "3 tensors")),
        ("gather list missing on dst", lambda: dist.gather(f32, None, dst=rank),
         "InvalidArgument", ("gather_list", "required")),
        ("gather list on non-dst", lambda: dist.gather(f32, [f32, f32], dst=other),
         "InvalidArgument", ("gather_list", "None")),
        ("scatter list too short on src", lambda: dist.scatter(f32, [f32], src=rank),
         "InvalidArgument", ("scatter_list", "1 tensors")),
        ("scatter list on non-src", lambda: dist.scatter(f32, [f32, f32], src=other),
         "InvalidArgument", ("scatter_list", "None")),
        ("all_to_all lengths", lambda: dist.all_to_all([f32.copy()], [f32, f32]),
         "InvalidArgument", ("output_tensor_list", "1 tensors")),
        ("reduce_scatter list too long", lambda: dist.reduce_scatter(
            f32.copy(), [f32, f32, f32]), "InvalidArgument", ("input_list", "3 tensors")),
        ("all_gather_object list length", lambda: dist.all_gather_object([None], 1),
         "InvalidArgument", ("object_list", "length 2")),
        ("gather_object list length on dst", lambda: dist.gather_object(
            1, [None] * 3, dst=rank), "InvalidArgument", ("object_gather_list",)),
        ("scatter_object_list input length on src", lambda: dist.scatter_object_list(
            [None], [1], src=rank), "InvalidArgument", ("scatter_object_input_list",)),
        # size mismatches
        ("all_gather element size", lambda: dist.all_gather(
            [np.zeros(4, np.float32), np.zeros(5, np.float32)], f32),
         "InvalidArgument", ("tensor_list[1]", "5 elements", "expected 4")),
        ("all_gather_into_tensor size", lambda: dist.all_gather_into_tensor(
            np.zeros(7, np.float32), f32), "InvalidArgument", ("output_tensor", "8")),
        ("reduce_scatter_tensor size", lambda: dist.reduce_scatter_tensor(
            np.zeros(2, np.float32), np.zeros(5, np.float32)), "InvalidArgument",
         ("input", "5 elements")),
        ("all_to_all_single splits do not sum", lambda: dist.all_to_all_single(
            rows4, rows4.copy(), [1, 2], [2, 2]), "InvalidArgument", ("sum to 3", "4 rows")),
        ("all_to_all_single wrong split count", lambda: dist.all_to_all_single(
            rows4, rows4.copy(), [4], [2, 2]), "InvalidArgument", ("split sizes",)),
        ("all_to_all_single indivisible", lambda: dist.all_to_all_single(
            np.zeros(3, np.float32), np.zeros(3, np.float32)), "InvalidArgument",
         ("divisible",)),
        # dtype mismatch inside one call
        ("all_gather mixed dtypes", lambda: dist.all_gather(
            [np.zeros(4, np.float32), np.zeros(4, np.float64)], f32), "InvalidArgument",
         ("tensor_list[1]", "float64", "float32")),
        ("all_gather_into_tensor dtypes", lambda: dist.all_gather_into_tensor(
            np.zeros(8, np.float64), f32), "InvalidArgument", ("float64", "float32")),
        ("all_to_all_single dtypes", lambda: dist.all_to_all_single(
            np.zeros(4, np.int64), f32), "InvalidArgument", ("int64", "float32")),
        # unsupported dtype/op combinations
        ("AVG on int", lambda: dist.all_reduce(i32, op=dist.ReduceOp.AVG), "InvalidArgument",
         ("AVG", "int32")),
        ("BAND on float", lambda: dist.all_reduce(f32, op=dist.ReduceOp.BAND),
         "InvalidArgument", ("BAND", "float32")),
        ("MIN on complex", lambda: dist.all_reduce(c64, op=dist.ReduceOp.MIN),
         "InvalidArgument", ("MIN", "complex")),
        ("MAX on complex reduce", lambda: dist.reduce(c64, dst=0, op=dist.ReduceOp.MAX),
         "InvalidArgument", ("MAX", "complex")),
        ("BXOR on float reduce_scatter", lambda: dist.reduce_scatter_tensor(
            np.zeros(2, np.float32), f32, op=dist.ReduceOp.BXOR), "InvalidArgument",
         ("BXOR",)),
        ("unknown reduce op", lambda: dist.all_reduce(f32, op="median"), "InvalidArgument",
         ("reduce op",)),
        ("async misuse raises at the call", lambda: dist.all_reduce(
            i32, op=dist.ReduceOp.AVG, async_op=True), "InvalidArgument", ("AVG",)),
        # buffers
        ("numpy non-contiguous", lambda: dist.all_reduce(strided), "InvalidArgument",
         ("contiguous",)),
        ("numpy read-only output", lambda: dist.all_reduce(ro), "InvalidArgument",
         ("read-only",)),
        ("numpy read-only recv", lambda: dist.recv(ro, src=other), "InvalidArgument",
         ("read-only",)),
        ("numpy object dtype", lambda: dist.all_reduce(np.array([object()])),
         "InvalidArgument", ("dtype",)),
        ("python list as tensor", lambda: dist.all_reduce([1.0, 2.0]), "InvalidArgument",
         ("torch.Tensor or numpy.ndarray",)),
        # objects: the safe serializer refuses code, explaining the opt-in
        ("lambda via all_gather_object", lambda: dist.all_gather_object(
            [None, None], lambda: 1), "InvalidArgument", ("allow_pickle", "function")),
        ("custom class via broadcast_object_list", lambda: dist.broadcast_object_list(
            [_Custom()], src=rank), "InvalidArgument", ("allow_pickle", "_Custom")),
        ("custom class via send_object_list", lambda: dist.send_object_list(
            [_Custom()], dst=other), "InvalidArgument", ("allow_pickle",)),
        ("custom class via gather_object", lambda: dist.gather_object(
            _Custom(), [None, None], dst=rank), "InvalidArgument", ("allow_pickle",)),
    ]
    if torch is not None:
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        leaf = torch.ones(4, requires_grad=True)
        cases += [
            ("torch non-contiguous", lambda: dist.all_reduce(t.t()), "InvalidArgument",
             ("contiguous",)),
            ("torch leaf requiring grad", lambda: dist.all_reduce(leaf), "InvalidArgument",
             ("requires grad",)),
            ("torch leaf requiring grad recv", lambda: dist.recv(leaf, src=other),
             "InvalidArgument", ("requires grad",)),
            ("float8 all_reduce", lambda: dist.all_reduce(
                torch.zeros(4, dtype=torch.float8_e4m3fn)), "InvalidArgument",
             ("float8_e4m3fn",)),
            ("float8 reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(
                torch.zeros(2, dtype=torch.float8_e5m2), torch.zeros(4, dtype=torch.float8_e5m2)),
             "InvalidArgument", ("float8_e5m2",)),
            ("torch dtype mismatch all_gather", lambda: dist.all_gather(
                [torch.zeros(3), torch.zeros(3, dtype=torch.float16)], torch.zeros(3)),
             "InvalidArgument", ("float16",)),
            ("torch AVG on int64", lambda: dist.all_reduce(
                torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG), "InvalidArgument",
             ("AVG",)),
            ("sparse tensor", lambda: dist.all_reduce(torch.zeros(3).to_sparse()),
             "InvalidArgument", ("layout",)),
        ]
    return cases


class _Custom:
    pass


def _misuse_then_sync(rank: int, world: int, use_torch: bool) -> list[str]:
    torch = None
    if use_torch:
        import torch as torch_mod

        torch = torch_mod
    other = 1 - rank
    g0 = dist.new_group([0])
    g1 = dist.new_group([1])
    g_self, g_other = (g0, g1) if rank == 0 else (g1, g0)
    problems: list[str] = []
    for phase in range(2):
        if phase == rank:  # one rank misbehaves while the other already waits
            for name, thunk, exc, needles in _misuse_cases(rank, other, g_self, g_other, torch):
                expect(problems, name, thunk, exc, *needles)
            marker = np.full(3, 100.0 + rank, np.float32)
            dist.send(marker, dst=other, tag=7)
        else:
            got = np.zeros(3, np.float32)
            src = dist.recv(got, src=None, tag=7)  # a stray user frame would come first
            if src != other or got.tolist() != [100.0 + other] * 3:
                problems.append(f"phase {phase}: marker from {src} was {got.tolist()}")
        a = np.full(5, float(rank + 1), np.float32)
        dist.all_reduce(a)  # would mismatch or time out if a sequence number was taken
        if a.tolist() != [3.0] * 5:
            problems.append(f"phase {phase}: all_reduce gave {a.tolist()}")
        objs: list[Any] = [None, None]
        dist.all_gather_object(objs, {"rank": rank, "phase": phase})
        if objs != [{"rank": 0, "phase": phase}, {"rank": 1, "phase": phase}]:
            problems.append(f"phase {phase}: all_gather_object gave {objs}")
    return problems


@pytest.mark.parametrize("use_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.procs
def test_misuse_raises_locally_and_leaves_the_job_in_sync(use_torch: bool) -> None:
    if use_torch:
        pytest.importorskip("torch")
    results = run_ranks(_misuse_then_sync, 2, args=(use_torch,), timeout=90,
                        init_kwargs={"timeout": 10.0})
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        assert res.value == [], f"rank {res.rank}:\n" + "\n".join(res.value)


# --- pickle opt-in -------------------------------------------------------------------------


def _pickle_opt_in(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    objs: list[Any] = [None, None]
    dist.all_gather_object(objs, _Custom() if rank else complex(rank, 1), allow_pickle=True)
    out["all_gather_object"] = [type(o).__name__ for o in objs]
    blist: list[Any] = [None]
    if rank == 0:
        blist = [_Custom()]
    dist.broadcast_object_list(blist, src=0, allow_pickle=True)
    out["broadcast_object_list"] = type(blist[0]).__name__
    # pickle on the sender only: the receiver refuses to unpickle, saying why
    if rank == 0:
        dist.send_object_list([_Custom()], dst=1, allow_pickle=True)
        out["refused"] = ""
    else:
        problems: list[str] = []
        out["refused"] = expect(problems, "recv pickled without opt-in",
                                lambda: dist.recv_object_list([None], src=0),
                                "InvalidArgument", "rank 0", "pickled", "allow_pickle")
        out["problems"] = problems
    # still in sync afterwards
    a = np.ones(2, np.float32)
    dist.all_reduce(a)
    out["after"] = a.tolist()
    return out


@pytest.mark.procs
def test_pickle_needs_opt_in_on_every_rank() -> None:
    results = run_ranks(_pickle_opt_in, 2, timeout=60, init_kwargs={"timeout": 10.0})
    for res in results:
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.message}\n{res.traceback}"
        v = res.value
        assert v["all_gather_object"] == ["complex", "_Custom"]
        assert v["broadcast_object_list"] == "_Custom"
        assert v["after"] == [2.0, 2.0]
    assert results[1].value["problems"] == []
    assert "RANKWISE_ALLOW_PICKLE" in results[1].value["refused"]


def _object_misuse_on_all_ranks(rank: int, world: int) -> str:
    dist.all_gather_object([None, None], lambda x: x)
    return "sent"


@pytest.mark.procs
def test_unpicklable_object_fails_on_every_rank_without_a_hang() -> None:
    results = run_ranks(_object_misuse_on_all_ranks, 2, timeout=60,
                        init_kwargs={"timeout": 10.0})
    assert_every_rank(results, "InvalidArgument", "allow_pickle", within=5.0)
