"""Ray Train's ``TorchTrainer`` as its users write it: 2 CPU workers, ``TorchConfig()``
(Ray's own ``init_process_group("gloo")``), no rankwise import in the training loop.
Ray, not ``rankwise run``, starts the workers, so the switch is ``RANKWISE_TORCH_CHECKS``
in their environment (``runtime_env``), read by rankwise's ``torch.backends`` entry point
at ``import torch`` in each worker.

    ray_train_plain.py OUT TMP off|cpu [extra]

Each worker writes OUT/rank<R>.json (its backend and final weights) or, when its loop
fails, OUT/error<R>.json (when, and the failure as rankwise reads it). The driver writes
OUT/driver.json (how ``fit`` ended). TMP: Ray's session folder (short: socket paths).
``extra``: worker 1 makes one all_reduce the other does not make (@ray-extra), at step 1.
"""

import json
import sys
import time
from pathlib import Path

import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

OUT, TMP, CHECKS = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
EXTRA = sys.argv[4:] == ["extra"]


def loop(config):
    import ray.train.torch
    import torch
    import torch.distributed as dist

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            if config["extra"] and rank == 1 and step == 1:
                (OUT / "extra_at").write_text(repr(time.time()))
                dist.all_reduce(torch.ones(3))  # @ray-extra
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:
        at = time.time()
        import rankwise  # only to read a failure torch's DDP re-wrapped

        original = rankwise.unwrap(exc)
        (OUT / f"error{rank}.json").write_text(json.dumps(
            {"at": at, "type": type(original).__name__, "text": str(original)}))
        raise
    weights = model.module.weight.reshape(-1).tolist()
    got = {"backend": str(dist.get_backend()), "weights": weights}
    (OUT / f"rank{rank}.json").write_text(json.dumps(got))


def main():
    env = {} if CHECKS == "off" else {"RANKWISE_TORCH_CHECKS": CHECKS}
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=TMP, object_store_memory=100 << 20,
             runtime_env={"env_vars": env})
    try:
        trainer = TorchTrainer(loop, train_loop_config={"extra": EXTRA},
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               torch_config=TorchConfig(),
                               run_config=RunConfig(storage_path=str(OUT / "ray"), name="job"))
        try:
            trainer.fit()
            ended = {"ok": True}
        except ray.train.TrainingFailedError as exc:  # the workers' errors inside
            ended = {"ok": False, "type": type(exc).__name__, "text": str(exc)}
        ended["at"] = time.time()
        (OUT / "driver.json").write_text(json.dumps(ended))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
