"""A user's fine-tuning script in the order lightning-hydra-template runs one: a plain `L.Trainer`, transformers'
own `from_pretrained` of a bf16 `save_pretrained` folder in `__init__`, `trainer.validate` before `fit`, a
`ModelCheckpoint` on `val_loss`, then `trainer.test(ckpt_path="best")` and `trainer.predict`; the optimizer a
`functools.partial` in the module's hyperparameters (what Hydra's `_partial_: true` gives the template's modules), so
in every checkpoint; then the tested model written by `lightning_dist.save_pretrained` (OUT_DIR/exported, in fp32,
and OUT_DIR/exported-bf16). Writes
OUT_DIR/rank<N>.json: each stage's result and the dtypes the trainable weights trained in.

    python tests/stages_script.py OUT_DIR FOLDER ld_deepspeed_stage_3
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lightning_dist


class FineTune(L.LightningModule):
    def __init__(self, folder: str, optimizer: Callable[..., torch.optim.Optimizer]):
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_pretrained(folder)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if batch_idx == 0:
            self.trainable_dtypes = sorted({str(p.dtype) for p in self.parameters() if p.requires_grad})
        outputs = self.model(input_ids=ids, labels=ids)
        self.log("train_loss", outputs.loss, prog_bar=True)
        return outputs.loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("test_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids).logits.argmax(-1)

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


def loader() -> DataLoader:
    # The task the folder's model was "pretrained" on: counting up from a random start.
    starts = torch.randint(0, 256, (32, 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset((starts + torch.arange(16)) % 256), batch_size=4)


def main(out_dir: str, folder: str, strategy: str) -> None:
    checkpoint = ModelCheckpoint(dirpath=Path(out_dir, "checkpoints"), monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, callbacks=[checkpoint],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = FineTune(folder, functools.partial(torch.optim.AdamW, lr=1e-3))
    (before,) = trainer.validate(model, dataloaders=loader())
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader())
    (tested,) = trainer.test(model, dataloaders=loader(), ckpt_path="best")
    predictions = trainer.predict(model, dataloaders=loader())
    lightning_dist.save_pretrained(model.model, Path(out_dir, "exported"))  # every rank, as the docs say
    lightning_dist.save_pretrained(model.model, Path(out_dir, "exported-bf16"), dtype=torch.bfloat16)
    result = {"validate_before": before["val_loss"], "best_score": float(checkpoint.best_model_score),
              "best_path": Path(checkpoint.best_model_path).name, "test": tested["test_loss"],
              "trainable_dtypes": model.trainable_dtypes, "predictions": [list(p.shape) for p in predictions]}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
