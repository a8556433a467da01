"""The shared-memory collective core on real processes (``rankwise.engines.shm``).

Each test spawns fresh ranks (``run_ranks`` kills them at its hard timeout), compares
results with numpy computed from the same deterministic inputs, checks that results
are bit-identical across ranks (each rank returns a digest), and that failures raise
the right class on every rank within a bound. A FileStore in tmp_path is the rendezvous.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from _transports import shm_thread_groups

from rankwise.engines.shm.chunks import padding, plan_chunks
from rankwise.identity import callsite as _callsite
from rankwise.identity.calls import Fingerprint
from rankwise.shmem.layout import Layout
from rankwise.testing import run_ranks
from rankwise.wire.buffers import _NUMPY_NATIVE, ReduceOp, dtype_by_code
from rankwise.wire.frames import Op

SLOT = 65536  #: small slots, so modest sizes exercise chunking
SIZES = [0, 1, 7, 4099, 70001]  #: 70001 float32 > 4 slots


def _group(rank: int, size: int, store_path: str, **kw: Any) -> Any:
    from rankwise.engines.shm import ShmGroup
    from rankwise.store import FileStore

    store = FileStore(store_path, size, timeout=20)
    kw.setdefault("slot_bytes", SLOT)
    return ShmGroup(store, "g", rank, size, timeout=20, **kw)


def _fp(op: Op, dtype_code: int = 1, reduce: int = 0, root: int = -1) -> Fingerprint:
    return Fingerprint(int(op), dtype_code, reduce, 0, root, -1)


def _data(rank: int, n: int, dt: np.dtype[Any], salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    return rng.integers(1, 5, n).astype(dt)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def _deadline() -> float:
    return time.monotonic() + 20


# --- workers (module level: spawned processes import them) ---------------------------

def w_reductions(rank: int, size: int, path: str, cases: list[tuple[str, str, int]],
                 slot: int = SLOT) -> Any:
    g = _group(rank, size, path, slot_bytes=slot)
    site = _callsite.capture()
    out = []
    for dname, opname, n in cases:
        op = getattr(ReduceOp, opname)
        d = _NUMPY_NATIVE[np.dtype(dname)]
        a = _data(rank, n, d.storage)
        g.all_reduce(_fp(Op.all_reduce, d.code, op.code), site, a, d, op, _deadline())
        r = _data(rank, n, d.storage, 1)
        g.reduce(_fp(Op.reduce, d.code, op.code, size - 1), site, r, d, op, _deadline())
        rs_in = [_data(rank, n, d.storage, 2 + j) for j in range(size)]
        rs = np.zeros(n, d.storage)
        g.reduce_scatter(_fp(Op.reduce_scatter, d.code, op.code), site, rs, rs_in, d, op,
                         _deadline())
        out.append((a, r, rs))
    g.close()
    return out


def w_moves(rank: int, size: int, path: str, sizes: list[int]) -> Any:
    g = _group(rank, size, path)
    site = _callsite.capture()
    out = []
    for n in sizes:
        b = _data(rank, n, np.dtype(np.float32))
        g.broadcast(_fp(Op.broadcast, root=1 % size), site, b, _deadline())
        ag = [np.zeros(n, np.float32) for _ in range(size)]
        g.all_gather(_fp(Op.all_gather), site, _data(rank, n, np.dtype(np.float32)), ag,
                     _deadline())
        big = np.zeros(size * n, np.float32)  # all_gather_into_tensor: views of one tensor
        g.all_gather(_fp(Op.all_gather_into_tensor), site,
                     _data(rank, n, np.dtype(np.float32)),
                     [big[j * n:(j + 1) * n] for j in range(size)], _deadline())
        ga = [np.zeros(n, np.float32) for _ in range(size)] if rank == 0 else None
        g.gather(_fp(Op.gather, root=0), site, _data(rank, n, np.dtype(np.float32)), ga,
                 _deadline())
        sc = np.zeros(n, np.float32)
        ins = [_data(rank, n, np.dtype(np.float32), 10 + j) for j in range(size)]
        g.scatter(_fp(Op.scatter, root=size - 1), site, sc,
                  ins if rank == size - 1 else None, _deadline())
        # all_to_all with per-pair sizes: rank i sends n + i + j elements to rank j
        a2a_in = [_data(rank, n + rank + j, np.dtype(np.float32), 20 + j) for j in range(size)]
        a2a_out = [np.zeros(n + i + rank, np.float32) for i in range(size)]
        g.all_to_all(_fp(Op.all_to_all_single), site, a2a_out, a2a_in, _deadline())
        g.barrier(_fp(Op.barrier), site, _deadline())
        out.append((b, ag, big, ga, sc, a2a_out))
    g.close()
    return out


def _np_reduce(xs: list[np.ndarray], opname: str, dcode: int) -> np.ndarray:
    d = dtype_by_code(dcode)
    assert d is not None
    acc = xs[0].copy()
    from rankwise.wire.buffers import divide_in_place, reduce_into
    for x in xs[1:]:
        reduce_into(acc, x, d, getattr(ReduceOp, opname))
    if opname == "AVG":
        divide_in_place(acc, d, len(xs))
    return acc


def _ok(results: list[Any]) -> list[Any]:
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
                              for r in bad)
    return [r.value for r in results]


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("rankwise-shm-")}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.procs
def test_reductions_match_numpy_and_are_identical(size: int, tmp_path: Any) -> None:
    cases = [(d, o, n) for d, o in [("float32", "SUM"), ("float64", "AVG"), ("float16", "MAX"),
                                    ("int32", "PRODUCT"), ("int64", "BXOR"), ("bool", "SUM"),
                                    ("uint8", "MIN")]
             for n in (SIZES if d == "float32" else [0, 5, 40000])]
    _check_reductions(size, cases, SLOT, tmp_path)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.procs
def test_every_all_reduce_path_with_larger_slots(size: int, tmp_path: Any) -> None:
    """Slots of 256 KiB: one round (<= 64 KiB, cached views reused across calls and
    shapes), two rounds (one chunk up to a slot), and the chunked pipeline (> a slot),
    with 3 ranks splitting chunks unevenly."""
    cases = [(d, o, n) for d, o in [("float32", "SUM"), ("float64", "AVG"), ("bool", "MAX"),
                                    ("int16", "MIN")]
             for n in (3, 16384 // np.dtype(d).itemsize, 3, 50001, 262144 // np.dtype(d).itemsize,
                       300001)]
    _check_reductions(size, cases, 256 << 10, tmp_path)


def _check_reductions(size: int, cases: list[tuple[str, str, int]], slot: int,
                      tmp_path: Any) -> None:
    vals = _ok(run_ranks(w_reductions, size, args=(str(tmp_path / "s"), cases, slot),
                         init=False, timeout=120))
    for k, (dname, opname, n) in enumerate(cases):
        d = _NUMPY_NATIVE[np.dtype(dname)]
        want = _np_reduce([_data(r, n, d.storage) for r in range(size)], opname, d.code)
        for r in range(size):
            a, red, rs = vals[r][k]
            np.testing.assert_array_equal(a, want, err_msg=f"all_reduce {dname} {opname} {n}")
            assert _digest(a) == _digest(vals[0][k][0])  # bit-identical everywhere
            mine = _data(r, n, d.storage, 1)
            if r == size - 1:
                np.testing.assert_array_equal(red, _np_reduce(
                    [_data(q, n, d.storage, 1) for q in range(size)], opname, d.code))
            else:
                np.testing.assert_array_equal(red, mine)  # non-roots untouched
            np.testing.assert_array_equal(rs, _np_reduce(
                [_data(q, n, d.storage, 2 + r) for q in range(size)], opname, d.code))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.procs
def test_data_movement(size: int, tmp_path: Any) -> None:
    vals = _ok(run_ranks(w_moves, size, args=(str(tmp_path / "s"), SIZES), init=False,
                         timeout=120))
    f32 = np.dtype(np.float32)
    for k, n in enumerate(SIZES):
        for r in range(size):
            b, ag, big, ga, sc, a2a = vals[r][k]
            np.testing.assert_array_equal(b, _data(1 % size, n, f32))
            for j in range(size):
                np.testing.assert_array_equal(ag[j], _data(j, n, f32))
                np.testing.assert_array_equal(big[j * n:(j + 1) * n], _data(j, n, f32))
                np.testing.assert_array_equal(a2a[j], _data(j, n + j + r, f32, 20 + r))
                if r == 0:
                    np.testing.assert_array_equal(ga[j], _data(j, n, f32))
            np.testing.assert_array_equal(sc, _data(size - 1, n, f32, 10 + r))


@pytest.mark.procs
def test_bfloat16_all_reduce(tmp_path: Any) -> None:
    vals = _ok(run_ranks(w_bf16, 2, args=(str(tmp_path / "s"),), init=False, timeout=60))
    assert vals[0] == vals[1]


def w_bf16(rank: int, size: int, path: str) -> Any:
    import torch

    from rankwise.wire.buffers import as_buffer
    g = _group(rank, size, path)
    t = torch.arange(50000, dtype=torch.bfloat16) * (rank + 1) / 7
    want = torch.zeros(50000)
    for q in range(size):
        want += torch.arange(50000, dtype=torch.float32) * (q + 1) / 7
    buf = as_buffer(t, "t", writable=True)
    g.all_reduce(_fp(Op.all_reduce, buf.dtype.code, ReduceOp.SUM.code), _callsite.capture(),
                 buf.array, buf.dtype, ReduceOp.SUM, _deadline())
    assert torch.allclose(t.float(), want.to(torch.bfloat16).float(), rtol=2e-2), (t, want)
    g.close()
    return _digest(buf.array)


# --- failures -----------------------------------------------------------------------

def w_mismatch(rank: int, size: int, path: str, kind: str) -> Any:
    g = _group(rank, size, path)
    site = _callsite.capture()
    g.barrier(_fp(Op.barrier), site, _deadline())
    if kind == "root":
        a = np.zeros(10, np.float32)
        g.broadcast(_fp(Op.broadcast, root=0 if rank == size - 1 else 1), site, a, _deadline())
    else:
        a = np.zeros(10 + (rank == 1), np.float32)
        d = _NUMPY_NATIVE[a.dtype]
        g.all_reduce(_fp(Op.all_reduce, 1, 1), site, a, d, ReduceOp.SUM, _deadline())


@pytest.mark.parametrize("size,kind", [(2, "root"), (4, "root"), (2, "count"), (4, "count")])
@pytest.mark.procs
def test_mismatch_raises_on_every_rank(size: int, kind: str, tmp_path: Any) -> None:
    res = run_ranks(w_mismatch, size, args=(str(tmp_path / "s"), kind), init=False, timeout=60)
    for r in res:
        assert r.raised("CollectiveMismatch"), (r.rank, r.error_type, r.message, r.traceback)
        assert "test_shm_core.py" in r.message  # both call sites are named
        assert ("root=" if kind == "root" else "count=") in r.message


def w_peer_dies(rank: int, size: int, path: str) -> Any:
    g = _group(rank, size, path)
    site = _callsite.capture()
    g.barrier(_fp(Op.barrier), site, _deadline())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        g.barrier(_fp(Op.barrier), site, time.monotonic() + 30)
    finally:
        elapsed = time.monotonic() - t0
        print(f"rank {rank} raised after {elapsed:.3f}s")
    return elapsed


@pytest.mark.parametrize("method", ["memfd", "file"])
@pytest.mark.procs
def test_sigkilled_peer_gives_peer_failure_quickly(method: str, tmp_path: Any) -> None:
    before = _shm_names()
    t0 = time.monotonic()
    res = run_ranks(w_peer_dies, 3, args=(str(tmp_path / "s"),), init=False, timeout=60,
                    env={"RANKWISE_SHM_METHOD": method})
    assert res[1].exitcode == -signal.SIGKILL
    for r in (res[0], res[2]):
        assert r.raised("PeerFailure"), (r.rank, r.error_type, r.message)
        assert "rank 1" in r.message
        assert r.elapsed < 3.0
    assert time.monotonic() - t0 < 30
    assert _shm_names() <= before


def w_timeout(rank: int, size: int, path: str) -> Any:
    g = _group(rank, size, path)
    site = _callsite.capture()
    if rank == 0:
        time.sleep(3)
        g.close()
        return None
    t0 = time.monotonic()
    try:
        g.barrier(_fp(Op.barrier), site, time.monotonic() + 0.5)
    finally:
        assert time.monotonic() - t0 < 1.5


@pytest.mark.procs
def test_timeout_gives_dist_timeout(tmp_path: Any) -> None:
    res = run_ranks(w_timeout, 2, args=(str(tmp_path / "s"),), init=False, timeout=60)
    assert res[1].raised("DistTimeout"), (res[1].error_type, res[1].message)
    assert "rank 0" in res[1].message


def w_leak(rank: int, size: int, path: str, how: str) -> Any:
    g = _group(rank, size, path, method="file")
    assert g.method == "file"
    site = _callsite.capture()
    g.barrier(_fp(Op.barrier), site, _deadline())
    if how == "raise" and rank == 0:
        raise RuntimeError("boom")
    if how == "kill" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "normal":
        g.close()


@pytest.mark.parametrize("how", ["normal", "raise", "kill"])
@pytest.mark.procs
def test_no_dev_shm_leftovers_with_file_fallback(how: str, tmp_path: Any) -> None:
    before = _shm_names()
    res = run_ranks(w_leak, 2, args=(str(tmp_path / "s"), how), init=False, timeout=60)
    assert res[1].ok
    assert _shm_names() <= before


@pytest.mark.procs
def test_memfd_is_default_and_creates_no_file(tmp_path: Any) -> None:
    before = _shm_names()
    vals = _ok(run_ranks(w_method, 2, args=(str(tmp_path / "s"),), init=False, timeout=60))
    assert vals == ["memfd", "memfd"]
    assert _shm_names() <= before


def w_method(rank: int, size: int, path: str) -> Any:
    g = _group(rank, size, path)
    g.barrier(_fp(Op.barrier), _callsite.capture(), _deadline())
    g.close()
    return g.method


@pytest.mark.procs
def test_orphan_file_of_dead_creator_is_swept() -> None:
    from rankwise.shmem.segment import SHM_DIR, _sweep_orphans

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    name = os.path.join(SHM_DIR, f"rankwise-shm-{dead}-deadbeef")
    open(name, "wb").close()
    locked = os.path.join(SHM_DIR, f"rankwise-shm-{dead}-feedface")  # creator in another
    fd = os.open(locked, os.O_RDWR | os.O_CREAT, 0o600)              # PID namespace
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_SH)
        _sweep_orphans()
        assert not os.path.exists(name)
        assert os.path.exists(locked)
    finally:
        os.close(fd)
        os.unlink(locked)


def test_too_small_dev_shm_names_the_fix(monkeypatch: Any) -> None:
    from rankwise.shmem import ShmUnavailable, segment

    class Tiny:
        f_bavail, f_frsize = 16, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny())
    with pytest.raises(ShmUnavailable, match="--shm-size"):
        segment._fit_slot(4, 4 << 20, "file", Layout)
    Half = type("Half", (), {"f_bavail": (64 << 20) // 4096, "f_frsize": 4096})
    monkeypatch.setattr(os, "statvfs", lambda p: Half())
    assert 65536 <= segment._fit_slot(8, 4 << 20, "file", Layout) < 4 << 20


def w_check_callback(rank: int, size: int, path: str) -> Any:
    from rankwise.errors import PeerFailure

    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise PeerFailure("control plane says rank 0 failed", rank=0)

    g = _group(rank, size, path, check=check)
    if rank == 0:
        time.sleep(4)
        return None
    g.barrier(_fp(Op.barrier), _callsite.capture(), time.monotonic() + 20)


@pytest.mark.procs
def test_check_callback_aborts_a_wait(tmp_path: Any) -> None:
    t0 = time.monotonic()
    res = run_ranks(w_check_callback, 2, args=(str(tmp_path / "s"),), init=False, timeout=60)
    assert res[1].raised("PeerFailure") and "control plane" in res[1].message
    assert res[1].elapsed < 3.0 and time.monotonic() - t0 < 30


def w_after_error(rank: int, size: int, path: str) -> Any:
    from rankwise.errors import CollectiveMismatch, DistError

    g = _group(rank, size, path)
    site = _callsite.capture()
    try:
        g.barrier(_fp(Op.barrier if rank else Op.all_reduce), site, _deadline())
    except CollectiveMismatch:
        pass
    try:
        g.barrier(_fp(Op.barrier), site, _deadline())
    except DistError as exc:
        return str(exc)
    return "no error"


@pytest.mark.procs
def test_group_is_unusable_after_an_error(tmp_path: Any) -> None:
    vals = _ok(run_ranks(w_after_error, 2, args=(str(tmp_path / "s"),), init=False,
                         timeout=60))
    assert all("unusable after an earlier error" in v for v in vals), vals


def test_auto_falls_back_to_a_file_when_a_peer_cannot_open_the_memfd(monkeypatch: Any) -> None:
    """Ranks as threads on a HashStore; rank 1 is refused /proc/<pid>/fd (as under
    another user or a hardened ptrace_scope): every rank ends on one /dev/shm file,
    which is gone once both mapped."""
    import threading

    from rankwise.shmem import segment
    from rankwise.store import HashStore

    real = segment._attach

    def attach(desc: str, nranks: int, kind: Any) -> Any:
        if desc.startswith("memfd") and threading.current_thread().name == "r1":
            raise PermissionError(13, "Permission denied (test)")
        return real(desc, nranks, kind)

    monkeypatch.setattr(segment, "_attach", attach)
    before = _shm_names()
    store = HashStore()
    got: dict[int, Any] = {}

    def run(r: int) -> None:
        got[r] = segment.open_segment(store, "t", r, 2, slot_bytes=65536, method="auto",
                                      timeout=10, kind=Layout)

    ts = [threading.Thread(target=run, args=(r,), name=f"r{r}") for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert [got[r].method for r in range(2)] == ["file", "file"]
    got[0].mm[8192] = 7
    assert got[1].mm[8192] == 7  # one segment
    assert _shm_names() <= before
    for s in got.values():
        s.mm.close()


def w_stress(rank: int, size: int, path: str, iters: int) -> Any:
    """Back-to-back mixed calls: ranks drift up to one round apart all the time, which is
    where a wrong ping-pong or fingerprint-parity argument would show."""
    g = _group(rank, size, path, slot_bytes=65536)
    site = _callsite.capture()
    d = _NUMPY_NATIVE[np.dtype(np.int64)]
    for i in range(iters):
        n = (i * 7919) % 40000 + 1  # spans small (one round) and chunked sizes
        kind = i % 3
        if kind == 0:
            a = np.full(n, rank + i, np.int64)
            g.all_reduce(_fp(Op.all_reduce, d.code, 1), site, a, d, ReduceOp.SUM, _deadline())
            want = sum(r + i for r in range(size))
            if not (a == want).all():
                raise AssertionError(f"iteration {i}: all_reduce wrong")
        elif kind == 1:
            b = np.full(n, rank * 1000 + i, np.int64)
            root = i % size
            g.broadcast(_fp(Op.broadcast, d.code, root=root), site, b, _deadline())
            if not (b == root * 1000 + i).all():
                raise AssertionError(f"iteration {i}: broadcast wrong")
        else:
            g.barrier(_fp(Op.barrier), site, _deadline())
    sleeps = g.ch.sleeps
    g.close()
    return sleeps


@pytest.mark.parametrize("sleeping", [False, True], ids=["default", "sleeping"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.procs
def test_stress_mixed_calls(size: int, sleeping: bool, tmp_path: Any, monkeypatch: Any) -> None:
    """``sleeping``: no spin, no yield, so every wait that finds a peer missing sleeps on
    the group's futex word and is woken by the rank that completes the round."""
    if sleeping:
        monkeypatch.setenv("RANKWISE_SHM_SPIN_US", "0")
        monkeypatch.setenv("RANKWISE_SHM_YIELD_US", "0")
    sleeps = _ok(run_ranks(w_stress, size, args=(str(tmp_path / "s"), 600), init=False,
                           timeout=240))
    if sleeping:
        assert sum(sleeps) > 0


def test_untrusted_lengths_in_the_segment_are_bounded() -> None:
    from rankwise.shmem.layout import R_SITE_LEN

    g0, g1 = shm_thread_groups(2)
    try:
        w = g0.ch.w
        w[g0.seg.layout.record_word(1, R_SITE_LEN)] = 1 << 40  # a hostile length
        assert g0.ch.peer_site(1) == "<corrupt call-site text>"
        w[g0.seg.layout.record_word(1, R_SITE_LEN)] = -5
        assert g0.ch.peer_site(1) == "<corrupt call-site text>"
    finally:
        g0.close()
        g1.close()


def test_a_foreign_header_is_refused(tmp_path: Any) -> None:
    from rankwise.shmem import ShmUnavailable, segment

    path = os.path.join(segment.SHM_DIR, f"{segment.FILE_PREFIX}{os.getpid()}-test")
    with open(path, "wb") as f:
        f.write(b"\x07" * 8192)
    try:
        with pytest.raises(ShmUnavailable, match="foreign header"):
            segment._attach(f"file {path}", 2, Layout)
        with pytest.raises(ShmUnavailable, match="unusable segment description"):
            segment._attach("file /etc/passwd", 2, Layout)
    finally:
        os.unlink(path)


def test_a_peer_two_rounds_ahead_is_an_error_not_data() -> None:
    from rankwise.errors import DistError
    from rankwise.shmem.layout import R_SEQ

    g0, g1 = shm_thread_groups(2)
    try:
        g0.ch.w[g0.seg.layout.record_word(1, R_SEQ)] = 3  # rank 1 "at round 3" while
        with pytest.raises(DistError, match="corrupt"):       # rank 0 waits for round 1
            g0.ch._check_peers([], 1, lambda: "barrier", False)
    finally:
        g0.close()
        g1.close()


def w_spin_adapts(rank: int, size: int, path: str) -> Any:
    g = _group(rank, size, path)
    site = _callsite.capture()
    spins = []
    for _ in range(12):
        if rank == 1:  # a peer that always arrives late: rank 0's spin never ends a wait
            end = time.monotonic() + 0.002
            while time.monotonic() < end:
                pass
        g.barrier(_fp(Op.barrier), site, _deadline())
        spins.append(g.ch._spin)
    policy = g.ch.policy.spin_s
    skewed = g.ch.arrivals.skewed
    g.close()
    return policy, spins, skewed


@pytest.mark.procs
def test_spin_shrinks_when_it_does_not_pay(tmp_path: Any, monkeypatch: Any) -> None:
    """A rank whose spins never end a wait (its peer is 2 ms late every time, as when
    the peer shares its core) stops spinning the policy's full budget, and takes its
    peers for skewed (its first waits then skip the yield stage: ``Arrivals``)."""
    monkeypatch.setenv("RANKWISE_SHM_SPIN_US", "50")
    monkeypatch.setenv("RANKWISE_SHM_SKEW_US", "100")  # on even with a CPU per rank
    vals = _ok(run_ranks(w_spin_adapts, 2, args=(str(tmp_path / "s"),), init=False,
                         timeout=60))
    policy, spins, skewed = vals[0]
    assert skewed
    assert policy == pytest.approx(50e-6)
    assert all(0 < s <= policy for s in spins)
    # halved after every wait it did not end: 50 us down to the 2 us floor within 5 rounds
    # (a round where load lines the ranks up by chance may double it once)
    assert min(spins) <= 4e-6 and spins[-1] <= policy / 4, spins


def w_many_chunks(rank: int, size: int, path: str) -> Any:
    g = _group(rank, size, path)
    d = _NUMPY_NATIVE[np.dtype(np.float32)]
    a = _data(rank, 5 * SLOT // 4 + 13, d.storage)  # several chunks
    g.all_reduce(_fp(Op.all_reduce, d.code, ReduceOp.SUM.code), _callsite.capture(), a,
                 d, ReduceOp.SUM, _deadline())
    rounds = g.statistics()["rounds"]
    g.close()
    return a, rounds


@pytest.mark.procs
def test_large_all_reduce_takes_one_round_per_chunk_plus_one(tmp_path: Any) -> None:
    """The chunk plan (``chunks.py``) as the engine runs it: the right bits, and one round
    per chunk plus one (a chunk fills the whole slot)."""
    vals = _ok(run_ranks(w_many_chunks, 3, args=(str(tmp_path / "s"),), init=False,
                         timeout=60))
    n = 5 * SLOT // 4 + 13
    want = _np_reduce([_data(r, n, np.dtype(np.float32)) for r in range(3)], "SUM", 1)
    plan = plan_chunks(n, 4, 3, SLOT + padding(3))
    assert plan.chunks >= 3
    for a, rounds in vals:
        np.testing.assert_array_equal(a, want)
        assert rounds == plan.chunks + 1  # one per chunk, plus one


def _past_a_page(data: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``data`` that starts ``offset`` bytes past a page boundary."""
    raw = np.empty(data.nbytes + 8192, np.uint8)
    skip = (offset - raw.ctypes.data) % 4096
    out = raw[skip:skip + data.nbytes].view(data.dtype)
    out[...] = data
    return out


def w_misaligned(rank: int, size: int, path: str, n: int, offsets: list[int]) -> Any:
    """The same calls, repeated (cached plans, both parities), on buffers at awkward
    distances from the page-aligned slots (``copying.py``'s slow path)."""
    g = _group(rank, size, path, slot_bytes=256 << 10)
    site = _callsite.capture()
    d = _NUMPY_NATIVE[np.dtype(np.float32)]
    out = []
    for k in range(3):
        for off in offsets:
            a = _past_a_page(_data(rank, n, d.storage, k), off)
            g.all_reduce(_fp(Op.all_reduce, d.code, ReduceOp.SUM.code), site, a, d,
                         ReduceOp.SUM, _deadline())
            b = _past_a_page(_data(rank, n, d.storage, 7), off)
            g.broadcast(_fp(Op.broadcast, root=0), site, b, _deadline())
            ag = [_past_a_page(np.zeros(n, np.float32), off) for _ in range(size)]
            g.all_gather(_fp(Op.all_gather), site, _past_a_page(_data(rank, n, d.storage, 8),
                                                                 off), ag, _deadline())
            out.append((a, b, ag))
    g.close()
    return out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.procs
def test_buffers_at_any_alignment_move_exactly(size: int, tmp_path: Any) -> None:
    n, offsets = 60_001, [4, 16, 2052]  # 240 KB: two chunks of 256 KiB slots at 3 ranks
    vals = _ok(run_ranks(w_misaligned, size, args=(str(tmp_path / "s"), n, offsets),
                         init=False, timeout=120))
    f32 = np.dtype(np.float32)
    for k in range(3):
        want = _np_reduce([_data(r, n, f32, k) for r in range(size)], "SUM",
                          _NUMPY_NATIVE[f32].code)
        for i, off in enumerate(offsets):
            for r in range(size):
                a, b, ag = vals[r][k * len(offsets) + i]
                np.testing.assert_array_equal(a, want, err_msg=f"all_reduce at +{off}")
                np.testing.assert_array_equal(b, _data(0, n, f32, 7))
                for j in range(size):
                    np.testing.assert_array_equal(ag[j], _data(j, n, f32, 8))


@pytest.mark.parametrize("how", ["closed", "failed", "exited"])
def test_a_peer_that_published_the_round_then_left_is_not_missing(how: str) -> None:
    """``missing`` is read before the peers' states: a peer may publish the round, finish
    and close (or exit) in between. That peer is not missing; one still behind is."""
    from rankwise.errors import PeerFailure
    from rankwise.shmem.layout import R_PID, R_SEQ, R_STATE, STATE_CLOSED, STATE_FAILED

    g0, g1 = shm_thread_groups(2)
    try:
        w, lay = g0.ch.w, g0.seg.layout
        if how == "exited":
            w[lay.record_word(1, R_PID)] = 2 ** 22 + 12345  # no such process
        else:
            w[lay.record_word(1, R_STATE)] = STATE_CLOSED if how == "closed" else STATE_FAILED
        w[lay.record_word(1, R_SEQ)] = 1  # rank 1 reached round 1 before leaving
        g0.ch._check_peers([1], 1, lambda: "barrier", True)  # a stale "missing": no raise
        w[lay.record_word(1, R_SEQ)] = 0  # it left before round 1: that is a failure
        with pytest.raises(PeerFailure, match="before reaching round 1"):
            g0.ch._check_peers([1], 1, lambda: "barrier", True)
    finally:
        w[lay.record_word(1, R_PID)] = os.getpid()
        g0.close()
        g1.close()
