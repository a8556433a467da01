"""The programs ``scripts/gpu-check`` runs on a GPU, one per step (``python3
scripts/gpu_check_cases.py CASE``). Each prints one ``RESULT: PASS|FAIL ...`` line and
exits 0 on PASS; ``scripts/gpu-check`` bounds each with its own timeout.

Cases:
- ``no-host-sync``: one rank on NCCL; a GPU sleep kernel holds the current stream, so an
  ``all_reduce`` cannot finish: the call must return at once (no host sync) with the
  stream still busy, and with ``timeout=3`` the watchdog must abort the communicator
  and the next call raise ``DistTimeout``.
- ``mismatch``: two ranks with CUDA tensors of different sizes on the staged engine
  (``CollectiveMismatch`` on both, within seconds); and a CPU tensor on one rank where
  the other passes a CUDA one on a ``cpu:gloo,cuda:nccl`` group: ``CollectiveMismatch``
  with a GPU per rank, the "would share one GPU" ``DistError`` on a single GPU.
- ``killed``: two ranks on CUDA tensors; rank 1 is killed (SIGKILL) after one step;
  rank 0's next call raises ``PeerFailure`` naming rank 1 within seconds.
- ``bench``: DDP step time of a CUDA MLP, rankwise against torch's own DDP (NCCL at one
  rank: NCCL needs a GPU per rank; gloo at two ranks sharing the GPU), alternated.
- ``host-time``: host time per 4-byte ``all_reduce`` at one rank, blocking and
  ``async_op=True`` then ``wait()``: rankwise's ``"nccl"`` and torch's ``"nccl"``
  (``ProcessGroupNCCL``), and torch on backend ``"rankwise"``, in alternating processes;
  ratios against torch (targets: 1.3x blocking, 1.5x async + wait); two alternations.
- ``torch-stack``: torch's own DDP and FSDP2 (``fully_shard``) on backend ``"rankwise"``
  against ``"nccl"`` at one rank: parameters bit-identical after the same steps (a FAIL
  otherwise), step-time ratio (target 1.05x).
- ``fsdp-mismatch``: two ranks sharing the GPU on backend ``"rankwise"``, FSDP2 over a
  layer one rank builds wider: ``CollectiveMismatch`` on both ranks naming the user's
  file:line of the forward call.

A program that cannot run what it checks here prints ``RESULT: SKIP: why`` (reported
as skipped, never as passed).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from typing import Any

#: seconds within which an error must reach every rank
WITHIN = 20.0
#: ``GPU_CHECK_CPU=1``: a smoke test of these programs without a GPU (CPU tensors staged
#: as CUDA ones would be; the NCCL-only parts are left out)
CPU = bool(os.environ.get("GPU_CHECK_CPU"))
DEV = "cpu" if CPU else "cuda"
ENV = {"RANKWISE_TENSOR_PATH": "staged"} if CPU else {}


def _sync() -> None:
    import torch

    if not CPU:
        torch.cuda.synchronize()


def _no_host_sync(rank: int, world: int) -> dict[str, Any]:
    import torch

    import rankwise as dist

    t = torch.ones(1 << 10, device="cuda")
    dist.all_reduce(t)  # the call site is confirmed; the communicator is up
    torch.cuda.synchronize()
    # 1.2e10 GPU cycles: 6-9 s on the current stream, past the group's 3 s timeout
    torch.cuda._sleep(int(1.2e10))  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    dist.all_reduce(t)  # ordered after the sleep: it cannot finish for seconds
    returned = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    out: dict[str, Any] = {"returned_s": round(returned, 4), "stream_busy_after": busy}
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # the watchdog's verdict reaches the next call
        try:
            dist.all_reduce(torch.ones(1 << 10, device="cuda"))
        except dist.DistTimeout as exc:
            out["next_call"] = f"DistTimeout after {time.perf_counter() - start:.1f}s: " \
                               f"{str(exc).splitlines()[0][:200]}"
            break
        except Exception as exc:  # noqa: BLE001 - reported as it is
            out["next_call"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            break
        time.sleep(0.25)
    return out


def case_no_host_sync() -> bool:
    from rankwise.testing import run_ranks

    res = run_ranks(_no_host_sync, 1, timeout=90,
                    init_kwargs={"backend": "nccl", "timeout": 3.0})[0]
    if not res.ok:
        print(f"RESULT: FAIL: {res.error_type}: {res.message}\n{res.traceback}")
        return False
    v = res.value
    ok = v["returned_s"] < 0.5 and v["stream_busy_after"] \
        and str(v.get("next_call", "")).startswith("DistTimeout")
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: all_reduce returned in {v['returned_s']}s "
          f"with the stream still busy={v['stream_busy_after']}; next call: "
          f"{v.get('next_call', 'no error within 30s')}")
    return bool(ok)


def _count_mismatch(rank: int, world: int) -> None:
    import torch

    import rankwise as dist

    dist.all_reduce(torch.ones(4 + rank, device=DEV))  # CALL: 4 vs 5 elements


def _plane_mismatch(rank: int, world: int) -> None:
    import torch

    import rankwise as dist

    dev = "cpu" if rank == 1 else f"cuda:{rank % torch.cuda.device_count()}"
    dist.all_reduce(torch.ones(4, device=dev))


def _killed(rank: int, world: int) -> None:
    import torch

    import rankwise as dist

    t = torch.ones(4, device=DEV)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)


def _expect(results: list[Any], errors: tuple[str, ...], needle: str, start: float,
            ranks: list[int] | None = None, within: float = WITHIN + 15) -> tuple[bool, str]:
    """Whether every rank (of ``ranks``) raised one of ``errors`` saying ``needle``
    within ``within`` seconds of ``start`` (the processes' start-up included)."""
    took = time.monotonic() - start
    lines = []
    ok = True
    for r in results:
        if ranks is not None and r.rank not in ranks:
            continue
        first = (r.message or "").splitlines()[0][:160] if r.message else ""
        good = (not r.ok) and r.error_type in errors and needle in (r.message or "")
        ok &= good
        lines.append(f"rank {r.rank}: {'ok' if good else 'UNEXPECTED'} "
                     f"{r.error_type}: {first}")
    ok &= took < within
    return ok, f"in {took:.1f}s; " + " | ".join(lines)


def case_mismatch() -> bool:
    import torch

    from rankwise.testing import run_ranks

    start = time.monotonic()
    res = run_ranks(_count_mismatch, 2, timeout=60, init_kwargs={"backend": "gloo"}, env=ENV)
    ok1, text1 = _expect(res, ("CollectiveMismatch",), "all_reduce", start)
    print(f"staged CUDA tensors, 4 vs 5 elements: {text1}")
    if CPU:
        print(f"RESULT: {'PASS' if ok1 else 'FAIL'}: (CPU smoke test: count case only)")
        return ok1
    start = time.monotonic()
    res = run_ranks(_plane_mismatch, 2, timeout=60,
                    init_kwargs={"backend": "cpu:gloo,cuda:nccl"})
    if torch.cuda.device_count() >= 2:
        ok2, text2 = _expect(res, ("CollectiveMismatch",), "on CUDA", start)
    else:  # NCCL needs a GPU per rank: the group itself is refused, naming both ranks
        ok2, text2 = _expect(res, ("DistError",), "would share one GPU", start)
    print(f"CPU tensor vs CUDA tensor on cpu:gloo,cuda:nccl "
          f"({torch.cuda.device_count()} GPU): {text2}")
    ok = ok1 and ok2
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: mismatches raised as documented")
    return ok


def case_killed() -> bool:
    from rankwise.testing import run_ranks

    start = time.monotonic()
    res = run_ranks(_killed, 2, timeout=60, init_kwargs={"backend": "gloo", "timeout": 60},
                    env=ENV)
    ok, text = _expect(res, ("PeerFailure",), "rank 1", start, ranks=[0])
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: killed rank 1, rank 0 {text}")
    return ok


# --- bench ------------------------------------------------------------------------------

def _mlp(width: int) -> Any:
    import torch

    layers: list[Any] = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(DEV)


def _steps(rank: int, world: int, impl: str, steps: int, width: int) -> list[float]:
    """Per-step wall times (s) of DDP on a CUDA MLP: ``impl`` rankwise or torch."""
    import torch

    torch.manual_seed(0)
    model = _mlp(width)
    ddp: Any
    if impl == "rankwise":
        from rankwise.nn import DistributedDataParallel as DDP
        ddp = DDP(model)
    else:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP
        ddp = TorchDDP(model)
    return _timed_steps(ddp, width, steps)


def _timed_steps(model: Any, width: int, steps: int) -> list[float]:
    """SGD steps on one fixed batch, each timed between device syncs; the first 5 are
    warm-up and not returned."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, width, device=DEV)
    times = []
    for i in range(steps + 5):
        _sync()
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        _sync()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return times


def _torch_ddp(rank: int, world: int, backend: str, port: int, steps: int,
               width: int) -> list[float]:
    import torch.distributed as tdist

    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    try:
        return _steps(rank, world, "torch", steps, width)
    finally:
        tdist.destroy_process_group()


def _rankwise_ddp(rank: int, world: int, steps: int, width: int) -> list[float]:
    return _steps(rank, world, "rankwise", steps, width)


def case_bench() -> bool:
    from rankwise.testing import free_port, run_ranks

    steps, width = (30, 2048) if not CPU else (3, 64)
    rows = []
    setups = ((1, "nccl", "nccl"), (2, "gloo", "gloo")) if not CPU else ((2, "gloo", "gloo"),)
    for world, rw_backend, torch_backend in setups:
        medians: dict[str, list[float]] = {"rankwise": [], "torch": []}
        for _ in range(2):  # alternate, twice
            for impl in ("rankwise", "torch"):
                if impl == "rankwise":
                    res = run_ranks(_rankwise_ddp, world, args=(steps, width), timeout=120,
                                    init_kwargs={"backend": rw_backend}, env=ENV)
                else:
                    res = run_ranks(_torch_ddp, world, args=(torch_backend, free_port(),
                                                             steps, width),
                                    timeout=120, init=False)
                bad = [r for r in res if not r.ok]
                if bad:
                    print(f"{impl} world {world}: {bad[0].error_type}: {bad[0].message}")
                    print("RESULT: FAIL: a benchmark run failed")
                    return False
                medians[impl].append(statistics.median(res[0].value) * 1e3)
        ratios = [a / b for a, b in zip(medians["rankwise"], medians["torch"], strict=True)]
        rows.append({"world": world, "rankwise": rw_backend, "torch": torch_backend,
                     "rankwise_ms": [round(m, 3) for m in medians["rankwise"]],
                     "torch_ms": [round(m, 3) for m in medians["torch"]],
                     "ratio": [round(r, 3) for r in ratios]})
        print(f"DDP step, MLP 6x{width}x{width}, batch 64, world {world}: rankwise "
              f"({rw_backend}) {medians['rankwise']} ms vs torch ({torch_backend}) "
              f"{medians['torch']} ms: ratio {min(ratios):.2f}-{max(ratios):.2f}x")
    print("BENCH " + json.dumps(rows))
    print("RESULT: PASS: measured (see the ratios; no threshold)")
    return True


# --- host time per call ------------------------------------------------------------------

#: calls per timed run, after as many warm-up calls
CALLS = 2000


def _per_call(call: Any, calls: int) -> float:
    """Median host seconds per ``call()`` over ``calls`` calls, after ``calls`` warm-ups
    (the GPU is synchronized before and after, never inside the timed loop)."""
    for _ in range(calls):
        call()
    _sync()
    times = []
    clock = time.perf_counter
    for _ in range(calls):
        start = clock()
        call()
        times.append(clock() - start)
    _sync()
    return statistics.median(times)


def _time_calls(all_reduce: Any, calls: int) -> dict[str, float]:
    import torch

    t = torch.ones(1, device=DEV)  # 4 bytes

    def blocking() -> None:
        all_reduce(t)

    def async_wait() -> None:
        all_reduce(t, async_op=True).wait()

    return {"blocking": _per_call(blocking, calls), "async": _per_call(async_wait, calls)}


def _host_rankwise(rank: int, world: int, calls: int) -> dict[str, float]:
    import rankwise as dist

    return _time_calls(dist.all_reduce, calls)


def _host_torch(rank: int, world: int, backend: str, port: int, calls: int
                ) -> dict[str, float]:
    import torch
    import torch.distributed as tdist

    if "rankwise" in backend:
        import rankwise.torch  # noqa: F401 - registers the backend
    if not CPU:
        torch.cuda.set_device(0)
    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    try:
        return _time_calls(tdist.all_reduce, calls)
    finally:
        tdist.destroy_process_group()


def case_host_time() -> bool:
    from rankwise.testing import free_port, run_ranks

    if CPU:
        print("RESULT: SKIP: host time per call needs NCCL (a GPU)")
        return True
    calls = CALLS
    runs: dict[str, list[dict[str, float]]] = {"rankwise": [], "torch": [],
                                               "torch-on-rankwise": []}
    for _ in range(2):  # alternate, twice (each run: a process, NCCL's init, the calls)
        for impl, done in runs.items():
            if impl == "rankwise":
                res = run_ranks(_host_rankwise, 1, args=(calls,), timeout=60,
                                init_kwargs={"backend": "nccl"})
            else:
                backend = "nccl" if impl == "torch" else "rankwise"
                res = run_ranks(_host_torch, 1, args=(backend, free_port(), calls),
                                timeout=60, init=False)
            if not res[0].ok:
                print(f"{impl}: {res[0].error_type}: {res[0].message}\n{res[0].traceback}")
                print("RESULT: FAIL: a timing run failed")
                return False
            done.append(res[0].value)
    rows = {}
    for kind, target in (("blocking", 1.3), ("async", 1.5)):
        base = [r[kind] for r in runs["torch"]]
        for impl in ("rankwise", "torch-on-rankwise"):
            mine = [r[kind] for r in runs[impl]]
            ratios = [a / b for a, b in zip(mine, base, strict=True)]
            rows[f"{impl}/{kind}"] = {"us": [round(m * 1e6, 1) for m in mine],
                                      "torch_us": [round(b * 1e6, 1) for b in base],
                                      "ratio": [round(r, 2) for r in ratios],
                                      "target": target,
                                      "met": statistics.median(ratios) <= target}
            print(f"4-byte all_reduce, {kind:<8} {impl:<18} "
                  f"{', '.join(f'{m * 1e6:.1f}' for m in mine)} us vs torch nccl "
                  f"{', '.join(f'{b * 1e6:.1f}' for b in base)} us: ratio "
                  f"{min(ratios):.2f}-{max(ratios):.2f}x (target {target}x: "
                  f"{'met' if statistics.median(ratios) <= target else 'MISSED'})")
    print("BENCH " + json.dumps(rows))
    missed = [k for k, v in rows.items() if not v["met"]]
    print(f"RESULT: PASS: measured; targets {'met' if not missed else 'missed: ' + ', '.join(missed)}")
    return True


# --- torch's DDP and FSDP2 on backend "rankwise" ------------------------------------------

def _stack_steps(rank: int, world: int, backend: str, port: int, wrap: str, steps: int,
                 width: int) -> dict[str, Any]:
    """torch's ``wrap`` (``ddp`` or ``fsdp2``) on ``backend``: the parameters' hash after
    ``steps`` steps and the step times."""
    import hashlib

    import torch
    import torch.distributed as tdist

    if "rankwise" in backend:
        import rankwise.torch  # noqa: F401 - registers the backend
    if not CPU:
        torch.cuda.set_device(0)
    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    try:
        torch.manual_seed(0)
        model = _mlp(width)
        if wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel as TorchDDP
            model = TorchDDP(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        times = _timed_steps(model, width, steps)
        digest = hashlib.sha256()
        for p in model.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return {"params": digest.hexdigest(), "ms": statistics.median(times) * 1e3}
    finally:
        tdist.destroy_process_group()


def _ms(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['ms']:.2f}" for r in runs)


def case_torch_stack() -> bool:
    from rankwise.testing import free_port, run_ranks

    steps, width = (20, 2048) if not CPU else (3, 64)
    base = "gloo" if CPU else "nccl"
    ours = "cpu:rankwise" if CPU else "rankwise"
    ok = True
    rows = []
    for wrap in ("ddp", "fsdp2"):
        got: dict[str, list[dict[str, Any]]] = {ours: [], base: []}
        for _ in range(2):  # alternate, twice
            for backend, done in got.items():
                res = run_ranks(_stack_steps, 1, args=(backend, free_port(), wrap, steps,
                                                       width), timeout=120, init=False)
                if not res[0].ok:
                    print(f"{wrap} on {backend}: {res[0].error_type}: {res[0].message}\n"
                          f"{res[0].traceback}")
                    print(f"RESULT: FAIL: torch's {wrap} on {backend} failed")
                    return False
                done.append(res[0].value)
        same = len({r["params"] for rs in got.values() for r in rs}) == 1
        ratios = [a["ms"] / b["ms"] for a, b in zip(got[ours], got[base], strict=True)]
        ok &= same
        rows.append({"wrap": wrap, "identical": same, "ratio": [round(r, 3) for r in ratios],
                     f"{ours}_ms": [round(r["ms"], 3) for r in got[ours]],
                     f"{base}_ms": [round(r["ms"], 3) for r in got[base]]})
        print(f"torch {wrap}, world 1, MLP 6x{width}x{width}: parameters "
              f"{'bit-identical' if same else 'DIFFER'} on {ours!r} and {base!r}; step "
              f"{_ms(got[ours])} ms vs {_ms(got[base])} ms: ratio "
              f"{min(ratios):.2f}-{max(ratios):.2f}x (target 1.05x: "
              f"{'met' if statistics.median(ratios) <= 1.05 else 'MISSED'})")
    print("BENCH " + json.dumps(rows))
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: torch's DDP and FSDP2 on {ours!r} "
          f"{'match' if ok else 'do not match'} {base!r} bit for bit")
    return ok


# --- a mismatch inside FSDP2 -----------------------------------------------------------

def _fsdp_mismatch(rank: int, world: int, backend: str, port: int) -> None:
    import torch
    import torch.distributed as tdist

    import rankwise.torch  # noqa: F401 - registers the backend

    if not CPU:
        torch.cuda.set_device(0)  # both ranks share the one GPU
    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64 + 2 * rank)).to(DEV)  # rank 1 wider
    fully_shard(model)
    model(torch.randn(8, 64, device=DEV)).sum().backward()  # CALL: FSDP2 all-gathers here


def case_fsdp_mismatch() -> bool:
    from rankwise.testing import free_port, run_ranks

    backend = "cpu:rankwise" if CPU else "rankwise"
    here = os.path.basename(__file__)
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# CALL: FSDP2" in text)
    start = time.monotonic()
    res = run_ranks(_fsdp_mismatch, 2, args=(backend, free_port()), timeout=90, init=False,
                    env=ENV)
    # start-up: two processes importing torch's FSDP (tens of seconds on a loaded host)
    ok, text = _expect(res, ("CollectiveMismatch",), f"{here}:{line}", start, within=75.0)
    print(f"FSDP2 on {backend!r}, 2 ranks sharing the {'CPU' if CPU else 'GPU'}, a layer "
          f"rank 1 builds wider: {text}")
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: the mismatch inside FSDP2 "
          f"{'is' if ok else 'is not'} named at {here}:{line}")
    return ok


CASES = {"no-host-sync": case_no_host_sync, "mismatch": case_mismatch,
         "killed": case_killed, "bench": case_bench, "host-time": case_host_time,
         "torch-stack": case_torch_stack, "fsdp-mismatch": case_fsdp_mismatch}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: gpu_check_cases.py {{{','.join(CASES)}}}", file=sys.stderr)
        return 2
    # the rank functions must pickle by an importable name, not ``__main__``'s
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check_cases

    return 0 if gpu_check_cases.CASES[argv[0]]() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
