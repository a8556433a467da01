"""One rank of ``benchmarks/torch_programs.py``: plain torch programs (backend "gloo", no
rankwise import, so `rankwise run` takes them over as a user's script) timing their own
steps. The models, data and parallel setups are the bit-identity tests' own
(``tests/launch_scripts/torch_same_bits.py``, ``tests/_torch_client_workloads.py``,
``tests/launch_scripts/framework_plain.py``); only the step count differs.

    _torch_programs_worker.py OUT WARMUP STEPS PROGRAM...

For each program, in order, every rank writes ``OUT/<program>-rank<R>.json``:
``{"backend": the default group's backend, "step_s": [seconds of each timed step],
"cpu_s": [the process's CPU seconds in each]}``,
after ``WARMUP`` untimed steps (first-call caches, sockets, torch's lazy init).
``lightning`` and ``accelerate`` make their own process group and must run alone.
``TORCH_PROGRAMS_PROFILE=DIR`` profiles each rank's timed steps (cProfile) into DIR.
``TORCH_PROGRAMS_PIN=1`` pins each rank, with every thread it starts, to CPU
``LOCAL_RANK % cpus`` before torch is imported (the same under either launcher).
"""

import cProfile
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if os.environ.get("TORCH_PROGRAMS_PIN") == "1":  # before torch starts a thread
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)})

import torch
import torch.distributed as dist
from torch import nn

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "launch_scripts")]
import _torch_client_workloads as workloads  # the tests' models and data
from torch_same_bits import ToyModel

Step = Callable[[int], None]
#: wall and CPU seconds of each timed step (CPU: the whole process's, every thread's)
Times = tuple[list[float], list[float]]
PROFILE = "TORCH_PROGRAMS_PROFILE"  #: a folder: profile each rank's timed steps into it
#: the programs that make their own default group (and so run in a job of their own)
FRAMEWORKS = ("lightning", "accelerate")


def _adam_step(model: nn.Module, data_rank: int) -> Step:
    """``_torch_client_workloads._train``'s step (Adam on an MSE loss), one at a time."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x, y = workloads._batch(data_rank, i)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def ddp_tutorial(rank: int, world: int, tmp: Path) -> Step:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    g = torch.Generator().manual_seed(rank)

    def step(i: int) -> None:
        optimizer.zero_grad()
        loss_fn(model(torch.randn(20, 10, generator=g)),
                torch.randn(20, 5, generator=g)).backward()
        optimizer.step()
    return step


def fsdp2(rank: int, world: int, tmp: Path) -> Step:
    from torch.distributed.fsdp import fully_shard

    model = workloads._mlp()
    mesh = workloads._mesh(dist.group.WORLD)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _adam_step(model, rank)


def tensor_parallel(rank: int, world: int, tmp: Path) -> Step:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = parallelize_module(workloads._mlp(), workloads._mesh(dist.group.WORLD),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _adam_step(model, 0)  # tensor parallel: every rank sees the same batch


def checkpoint(rank: int, world: int, tmp: Path) -> Step:
    """A step is one distributed checkpoint of an FSDP2 model saved and loaded back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    mesh = workloads._mesh(dist.group.WORLD)
    model = fully_shard(workloads._mlp(), mesh=mesh)
    fresh = fully_shard(workloads._mlp(seed=1), mesh=mesh)

    def step(i: int) -> None:
        where = str(tmp / f"ckpt{i}")  # a new checkpoint each step, as a job saves
        dcp.save({"model": model.state_dict()}, checkpoint_id=where)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=where)
        fresh.load_state_dict(state["model"])
    return step


def pipelining(rank: int, world: int, tmp: Path) -> Step:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    full = workloads._mlp()
    part = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)

    return lambda i: workloads.pipeline_step(schedule, opt, rank, i)


PROGRAMS: dict[str, Callable[[int, int, Path], Step]] = {f.__name__: f for f in (
    ddp_tutorial, fsdp2, tensor_parallel, checkpoint, pipelining)}
ALL = (*PROGRAMS, *FRAMEWORKS)


def _write(out: Path, name: str, rank: int, times: Times) -> None:
    got = {"backend": str(dist.get_backend()), "step_s": times[0], "cpu_s": times[1]}
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(got))


def timed(step: Step, warmup: int, steps: int, name: str) -> Times:
    """Wall and CPU seconds of each of ``steps`` calls of ``step``, after ``warmup`` untimed
    ones. With
    ``PROFILE`` set (a folder), the timed steps run under cProfile, written there as
    ``<name>-rank<R>.prof`` (the times then include the profiler's cost)."""
    for i in range(warmup):
        step(i)
    dist.barrier()  # every rank starts the timed steps together
    profile = cProfile.Profile() if os.environ.get(PROFILE) else None
    times: Times = ([], [])
    if profile is not None:
        profile.enable()
    for i in range(warmup, warmup + steps):
        start, cpu = time.perf_counter(), time.process_time()
        step(i)
        times[0].append(time.perf_counter() - start)
        times[1].append(time.process_time() - cpu)
    if profile is not None:
        profile.disable()
        profile.dump_stats(Path(os.environ[PROFILE]) / f"{name}-rank{dist.get_rank()}.prof")
    return times


def accelerate_loop(out: Path, warmup: int, steps: int) -> None:
    """``framework_plain.accelerate_loop``'s model and loop, ``warmup + steps`` steps."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(100 * acc.process_index + i)  # framework_plain's
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    _write(out, "accelerate", acc.process_index, timed(step, warmup, steps, "accelerate"))


def lightning_trainer(out: Path, warmup: int, steps: int) -> None:
    """``framework_plain.lightning_trainer``'s module; a step is the time from one
    training batch's end to the next one's (the loader, forward, backward, DDP's
    all_reduce, the optimizer)."""
    import lightning.pytorch as pl

    ends: list[tuple[float, float]] = []

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, data: list[torch.Tensor], step: int) -> torch.Tensor:
            x, y = data
            return nn.functional.mse_loss(self.layer(x), y)

        def on_train_batch_end(self, *args: object) -> None:
            ends.append((time.perf_counter(), time.process_time()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    total = warmup + steps + 1
    data = torch.utils.data.TensorDataset(torch.randn(16 * total, 4), torch.randn(16 * total, 2))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    pairs = list(zip(ends[warmup:], ends[warmup + 1:]))
    times = ([b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs])
    _write(out, "lightning", trainer.global_rank, times)


def main() -> None:
    out, warmup, steps, names = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4:]
    unknown = [n for n in names if n not in ALL]
    if unknown or not names or (len(names) > 1 and set(names) & set(FRAMEWORKS)):
        raise SystemExit(f"programs: {names} (one of {', '.join(FRAMEWORKS)} alone, or any "
                         f"of {', '.join(PROGRAMS)})")
    if names[0] == "accelerate":
        accelerate_loop(out, warmup, steps)
    elif names[0] == "lightning":
        lightning_trainer(out, warmup, steps)
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for name in names:
            tmp = out / f"{name}-files"
            tmp.mkdir(exist_ok=True)
            step = PROGRAMS[name](rank, world, tmp)
            _write(out, name, rank, timed(step, warmup, steps, name))
    if dist.is_initialized():  # neither framework does: torch's gloo may abort at exit else
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
