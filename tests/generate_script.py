"""A user's module that writes text with transformers' `generate` in `validation_step` (during fit) and in
`predict_step`, greedy, each text ending at its EOS token: rank 0's prompt reaches EOS at its first new token, rank
1's never does. Under a sharded engine every forward gathers parameters with every rank, so each rank must go on
until all texts have ended (transformers' `synced_gpus`). Writes OUT_DIR/rank<N>.json: the texts each stage wrote.

    python tests/generate_script.py OUT_DIR ld_deepspeed_stage_3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_dist  # noqa: F401  (registers the ld_* strategies)

PROMPTS = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])  # one a rank
NEW_TOKENS = 12


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config)


def eos_token() -> int:
    """The first token greedy decoding writes after rank 0's prompt."""
    with torch.no_grad():
        return int(build().generate(input_ids=PROMPTS[:1], max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])


class Writer(L.LightningModule):
    def __init__(self, eos_token_id: int, lr: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.model = build()
        self.written: list[list[int]] = []  # by validation_step

    def write(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=self.hparams.eos_token_id, pad_token_id=0)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        outputs = self.model(input_ids=ids, labels=ids)
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.written += self.write(ids).tolist()

    def predict_step(self, batch, batch_idx):
        (ids,) = batch
        return self.write(ids)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main(out_dir: str, strategy: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, num_sanity_val_steps=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    model = Writer(eos_token())
    prompts = DataLoader(TensorDataset(PROMPTS), batch_size=1)
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(PROMPTS), batch_size=1), val_dataloaders=prompts)
    predicted = trainer.predict(model, dataloaders=prompts)
    written = {"validation": model.written, "predict": [row for batch in predicted for row in batch.tolist()]}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(written))


if __name__ == "__main__":
    main(*sys.argv[1:])
