"""A user's script stopped in the middle of an epoch and resumed with `trainer.fit(ckpt_path="last")`, its train
loader as docs/checkpoints.md writes one: torchdata's `StatefulDataLoader` over its `StatefulDistributedSampler`
(shuffled, 2 workers), which Lightning saves the position of: the resumed run goes on with the next batch. Writes
OUT_DIR/losses-<STEPS>-<rank>.json: {global step: [loss, the batch's sample numbers]} of the steps it ran.

    python tests/stateful_loader_script.py OUT_DIR ld_fsdp STEPS [last]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_dist  # noqa: F401  (registers the ld_* strategies)


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = AutoModelForCausalLM.from_config(config)
        self.losses: dict[int, list] = {}
        self.tokens = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))  # 16 steps an epoch
        self.tokens[:, 0] = torch.arange(64)  # each sample's number

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        self.losses[self.global_step] = [loss.item(), ids[:, 0].tolist()]
        return loss

    def train_dataloader(self):
        data = TensorDataset(self.tokens)
        sampler = StatefulDistributedSampler(data, shuffle=True, seed=42,
                                             **self.trainer.strategy.distributed_sampler_kwargs)
        return StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out_dir: str, strategy: str, steps: str, ckpt_path: str | None = None) -> None:
    L.seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=Path(out_dir, "checkpoints"), save_last=True, every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=int(steps), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint],
                        use_distributed_sampler=False)
    trainer.fit(LanguageModel(), ckpt_path=ckpt_path)
    model = trainer.lightning_module
    Path(out_dir, f"losses-{steps}-{trainer.global_rank}.json").write_text(json.dumps(model.losses))


if __name__ == "__main__":
    main(*sys.argv[1:])
