"""Train with DDP, lose a rank, and go on in the same processes (docs/recovery.md).

    rankwise run -n 4 --on-failure=continue examples/recovery_ddp.py
    rankwise run -n 4 --on-failure=continue --respawn 1 examples/recovery_ddp.py --grow
    rankwise run -n 3 --on-failure=continue examples/recovery_ddp.py --torch-ddp

Rank ``--victim`` (the launcher's RANK) SIGKILLs itself at step ``--kill-at``. The others
raise ``PeerFailure`` inside DDP's backward, call ``rankwise.shrink()``, restore the state
that rankwise cannot (parameters and momentum from the new rank 0, the step counter, the
sampler's shard), and finish with one rank fewer. With ``--grow`` they call
``rankwise.grow()`` at every step boundary while the world is short (a few store requests),
so the replacement the launcher started (``--respawn``) is admitted at the first boundary
after it arrives, without the survivors waiting for it; if it is not there by the last
step, they wait for it (bounded) before finishing at the original size. At the end every rank compares
a hash of its parameters; rank 0 prints PASS or FAIL and the final world size.

With ``--torch-ddp`` the same loop runs on torch's own stack: ``init_process_group
("rankwise")`` and ``torch.nn.parallel.DistributedDataParallel``. torch's reducer re-wraps
the failure as a ``RuntimeError``; ``rankwise.unwrap`` gives the ``PeerFailure`` back, and
``shrink`` makes torch's default group again over the survivors.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import rankwise
import rankwise.torch  # registers backend "rankwise" (--torch-ddp)
from rankwise.nn import DistributedDataParallel
from rankwise.utils.data import DistributedSampler


def make_data(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return torch.utils.data.TensorDataset(x, y)


def parameters_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


class Trainer:
    """The state a recovery must restore, in one place: model, optimizer, step, data."""

    def __init__(self, batch: int) -> None:
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)
        self.data = make_data()
        self.batch = batch
        self.step = 0
        self.target = 0  #: the world size to grow back to (rank 0's at the start)
        self.ddp: nn.Module | None = None
        self.wrap: type[nn.Module] = DistributedDataParallel  #: torch's with --torch-ddp

    def sync(self) -> None:
        """After init, shrink or grow, on every rank in the same order: rank 0's step
        counter, target size and momentum to everyone, the model (DDP's construction
        broadcasts rank 0's parameters), and a sampler for the new rank and world size."""
        counters = torch.tensor([self.step, self.target])
        rankwise.broadcast(counters, src=0)
        self.step, self.target = (int(v) for v in counters.tolist())
        for p in self.net.parameters():  # a joiner has no momentum yet: zeros to receive
            state = self.opt.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            rankwise.broadcast(state["momentum_buffer"], src=0)
        self.ddp = self.wrap(self.net)
        self.sampler = DistributedSampler(self.data, num_replicas=rankwise.get_world_size(),
                                          rank=rankwise.get_rank(), shuffle=True, seed=0)

    def train_step(self) -> None:
        assert self.ddp is not None
        self.sampler.set_epoch(self.step)  # a fresh shard of the data every step
        indices = list(iter(self.sampler))[: self.batch]
        x, y = self.data[indices]
        self.opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(self.ddp(x), y)
        loss.backward()  # DDP's all_reduce: where a lost rank is noticed
        self.opt.step()
        self.step += 1


def admit(trainer: Trainer, wait_for: int, timeout: float) -> None:
    """At a step boundary, on every rank: let waiting replacements in (``rankwise.grow``);
    when one came, everyone (the newcomer too, after its init) restores the state."""
    m = rankwise.grow(wait_for=wait_for, timeout=timeout)
    if m.joined:
        trainer.sync()
        print(f"rank {m.rank} of {m.world_size}: admitted ranks {list(m.joined)} at step "
              f"{trainer.step} (t={time.time():.3f})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--victim", type=int, default=2,
                    help="launcher RANK that dies (-1: none; kill ranks or nodes from outside)")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="seconds of pretend compute per step (time to kill something)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--grow", action="store_true",
                    help="after the shrink, admit the replacement (needs --respawn)")
    ap.add_argument("--recovery-timeout", type=float, default=30.0)
    ap.add_argument("--no-recover", action="store_true",
                    help="let a PeerFailure end the process (to compare with a restart)")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "torch-gloo"),
                    help="gloo: rankwise's own engines; torch-gloo: torch's gloo moves the data")
    ap.add_argument("--torch-ddp", action="store_true",
                    help="torch's init_process_group('rankwise') and torch's DDP")
    args = ap.parse_args()

    if args.torch_ddp:
        dist.init_process_group("rankwise")
    else:
        rankwise.init_process_group(args.backend)
    launch_rank = int(os.environ.get("RANK", "0"))
    joined = rankwise.membership().joined != ()
    trainer = Trainer(args.batch)
    if args.torch_ddp:
        trainer.wrap = nn.parallel.DistributedDataParallel
    trainer.target = rankwise.get_world_size()  # a joiner gets rank 0's in sync()
    trainer.sync()
    if joined:
        print(f"rank {rankwise.get_rank()}: joined the running job at step {trainer.step} "
              f"({rankwise.get_world_size()} ranks)", flush=True)
    while trainer.step < args.steps:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.step == args.kill_at and launch_rank == args.victim and not joined \
                and first_attempt:  # (under --max-restarts, a restarted job does not die)
            print(f"rank {launch_rank}: SIGKILL to itself at step {trainer.step} "
                  f"(t={time.time():.3f})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if rankwise.get_rank() == 0 and trainer.step % 5 == 0:
            print(f"at step {trainer.step} with {rankwise.get_world_size()} ranks "
                  f"(t={time.time():.3f})", flush=True)
        if args.grow and rankwise.get_world_size() < trainer.target:
            admit(trainer, wait_for=0, timeout=args.recovery_timeout)  # cheap when nobody waits
        time.sleep(args.step_delay)
        try:
            trainer.train_step()
        except RuntimeError as exc:  # torch's DDP re-wraps it: unwrap gives it back
            error = rankwise.unwrap(exc)
            if args.no_recover or not isinstance(error, rankwise.PeerFailure):
                raise
            noticed = time.monotonic()
            m = rankwise.shrink(timeout=args.recovery_timeout)
            trainer.sync()
            print(f"rank {m.previous_rank} -> {m.rank} of {m.world_size}: lost ranks "
                  f"{list(m.lost)} ({type(error).__name__}); resumed at step {trainer.step} "
                  f"{time.monotonic() - noticed:.2f}s after the failure (t={time.time():.3f})",
                  flush=True)
    if args.grow and rankwise.get_world_size() < trainer.target:  # the replacement is late
        admit(trainer, trainer.target - rankwise.get_world_size(), args.recovery_timeout)
    hashes: list[object] = [None] * rankwise.get_world_size()
    rankwise.all_gather_object(hashes, parameters_hash(trainer.net))
    torchs = f", torch's {dist.get_world_size()}" if args.torch_ddp else ""
    if rankwise.get_rank() == 0:
        same = len(set(hashes)) == 1
        print(f"{'PASS' if same else 'FAIL'}: parameters {'identical' if same else 'differ'} "
              f"on {len(hashes)} ranks after {trainer.step} steps (world size "
              f"{rankwise.get_world_size()}{torchs}, engine "
              f"{rankwise.group.WORLD.engine_name()})", flush=True)
        if not same:
            return 1
    (dist if args.torch_ddp else rankwise).destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
