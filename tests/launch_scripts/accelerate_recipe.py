"""The README's accelerate recipe on backend "rankwise": make the group first, then
``Accelerator`` uses it (accelerate itself picks gloo for a CPU job and refuses
``InitProcessGroupKwargs(backend="rankwise")``). Prints one line per rank."""

import torch
import torch.distributed as dist

import rankwise.torch  # noqa: F401 - registers backend "rankwise"

dist.init_process_group("rankwise")  # first: accelerate then uses this group
from accelerate import Accelerator

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
loss = model(torch.randn(8, 4) + acc.process_index).square().mean()
acc.backward(loss)
opt.step()
weights = model.module.weight.reshape(-1).tolist()
total = acc.reduce(torch.tensor([1.0]), "sum").item()
print(f"accelerate rank {acc.process_index} of {acc.num_processes} on {dist.get_backend()} "
      f"{type(model).__name__} reduce {total} weights {weights}", flush=True)
dist.destroy_process_group()
