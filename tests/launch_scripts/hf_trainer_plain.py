"""Hugging Face's Trainer as its users write it: no rankwise import, the backend is the
Trainer's own choice (accelerate's "gloo" for a CPU job). A tiny BERT built from a config
(no downloads) trains a few steps on seeded random data. Each rank writes OUT/rank<R>.json
with the backend it got and its final weights.

    hf_trainer_plain.py OUT [extra]

``extra``: rank 1 makes one all_reduce the others do not make (@hf-extra), from a
callback at the start of step 1; a rank whose training raises writes OUT/raised<R> (when).
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

OUT = Path(sys.argv[1])
EXTRA = sys.argv[2:] == ["extra"]


class Stray(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if EXTRA and args.process_index == 1 and state.global_step == 1:
            (OUT / "extra_at").write_text(repr(time.time()))
            dist.all_reduce(torch.ones(3))  # @hf-extra


class Random(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main():
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=16, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=str(OUT / "hf"), use_cpu=True, max_steps=4,
                             per_device_train_batch_size=4, learning_rate=1e-2,
                             save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Random(64), callbacks=[Stray()])
    trainer.train()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = {"backend": str(dist.get_backend()), "weights": flat.tolist()}
    (OUT / f"rank{args.process_index}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        (OUT / f"raised{dist.get_rank()}").write_text(repr(time.time()))
        raise
    if dist.is_initialized():  # the Trainer does not: torch's gloo may abort at exit else
        dist.destroy_process_group()
