"""accelerate and Lightning as their users write them: no rankwise import, the framework
picks the backend name itself ("gloo" on CPU). Each rank writes OUT/rank<R>.json with the
backend the framework got and its final weights.

    framework_plain.py accelerate|lightning OUT [extra]

``extra``: rank 1 makes one all_reduce the others do not make (@framework-extra), at step 1.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
EXTRA = sys.argv[3:] == ["extra"]


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def stray(rank, step):
    if EXTRA and rank == 1 and step == 1:
        (OUT / "extra_at").write_text(repr(time.time()))
        dist.all_reduce(torch.ones(3))  # @framework-extra


def write(rank, weights):
    got = {"backend": str(dist.get_backend()), "weights": weights}
    (OUT / f"rank{rank}.json").write_text(json.dumps(got))


def accelerate_loop():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for step in range(3):
        x, y = batch(acc.process_index, step)
        stray(acc.process_index, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    write(acc.process_index, acc.unwrap_model(model).weight.reshape(-1).tolist())


def lightning_trainer():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, data, step):
            stray(self.global_rank, step)
            x, y = data
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    write(trainer.global_rank, model.layer.weight.reshape(-1).tolist())


if __name__ == "__main__":
    {"accelerate": accelerate_loop, "lightning": lightning_trainer}[FRAMEWORK]()
    if dist.is_initialized():  # neither framework does: torch's gloo may abort at exit else
        dist.destroy_process_group()
