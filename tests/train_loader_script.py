"""A user's fine-tuning script, its train loader as most write one: a plain `DataLoader(shuffle=True)` with worker
processes (or with `stateful`, torchdata's `StatefulDataLoader` over its `StatefulDistributedSampler`), a warmup
schedule over `self.trainer.estimated_stepping_batches` of AdamW (or plain SGD), and checkpoints every 5 steps and
at each epoch's end.
Trains 3 epochs of 9 batches a rank at 2 ranks (66 samples, 4 a batch) and writes OUT_DIR/seen-<rank>.json:
{global step: [epoch, batch_idx, the batch's sample numbers, loss]} of the steps it ran. With STOP=max_steps:N the
run is `Trainer(max_steps=N)`; with STOP=callback:N a callback stops it after global step N (`trainer.should_stop`, as
Lightning's Timer does at `max_time`). Either way Lightning runs the epoch-end hooks as it stops: the stopped epoch's
`end-epoch=E.ckpt` is saved there.

    [STOP=max_steps:N|callback:N] python tests/train_loader_script.py OUT_DIR STRATEGY DEVICES plain|stateful \
        adamw|sgd [CKPT_PATH]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import AutoModelForCausalLM, Qwen2Config, get_linear_schedule_with_warmup

import lightning_dist  # noqa: F401  (registers the ld_* strategies)


class LanguageModel(L.LightningModule):
    def __init__(self, loader: str, optimizer: str):
        super().__init__()
        config = Qwen2Config(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = AutoModelForCausalLM.from_config(config)
        self.loader, self.optimizer = loader, optimizer
        self.seen: dict[int, list] = {}
        self.tokens = torch.randint(0, 80, (66, 8), generator=torch.Generator().manual_seed(1))
        self.tokens[:, 0] = torch.arange(66)  # each sample's number

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        self.seen[self.global_step] = [self.current_epoch, batch_idx, ids[:, 0].tolist(), loss.item()]
        return loss

    def train_dataloader(self):
        data = TensorDataset(self.tokens)
        if self.loader == "plain":
            return DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
        sampler = StatefulDistributedSampler(data, shuffle=True, seed=0,
                                             **self.trainer.strategy.distributed_sampler_kwargs)
        return StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=2)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = get_linear_schedule_with_warmup(optimizer, 3, self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class StopAfter(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def main(out_dir: str, strategy: str, devices: str, loader: str, optimizer: str, ckpt_path: str | None = None) -> None:
    L.seed_everything(0)
    every_5_steps = ModelCheckpoint(dirpath=Path(out_dir, "checkpoints"), every_n_train_steps=5, save_top_k=-1)
    epoch_ends = ModelCheckpoint(dirpath=Path(out_dir, "checkpoints"), filename="end-{epoch}", save_top_k=-1,
                                 save_on_train_epoch_end=True)
    stop, _, step = os.environ.get("STOP", "").partition(":")
    callbacks = [every_5_steps, epoch_ends, *([StopAfter(int(step))] if stop == "callback" else [])]
    trainer = L.Trainer(accelerator="cpu", devices=int(devices), strategy=strategy, max_epochs=3,
                        max_steps=int(step) if stop == "max_steps" else -1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=loader == "plain")
    trainer.fit(LanguageModel(loader, optimizer), ckpt_path=ckpt_path)
    Path(out_dir, f"seen-{trainer.global_rank}.json").write_text(json.dumps(trainer.lightning_module.seen))


if __name__ == "__main__":
    main(*sys.argv[1:])
