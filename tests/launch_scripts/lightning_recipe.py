"""Lightning on backend "rankwise": ``DDPStrategy(process_group_backend="rankwise")`` under
``rankwise run`` (Lightning reads the launcher's torchelastic variables). Prints one line
per rank with the final weights. ``lightning_recipe.py gloo`` runs the same on gloo."""

import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy

import rankwise.torch  # noqa: F401 - registers backend "rankwise"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


backend = sys.argv[1] if len(sys.argv) > 1 else "rankwise"
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model = Tiny()
trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_epochs=2,
                     strategy=DDPStrategy(process_group_backend=backend),
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, loader)
weights = model.layer.weight.reshape(-1).tolist()
print(f"lightning rank {trainer.global_rank} of {trainer.world_size} on {dist.get_backend()} "
      f"steps {trainer.global_step} weights {weights}", flush=True)
