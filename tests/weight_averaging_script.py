"""A user's script that fine-tunes with Lightning's `EMAWeightAveraging` (or `StochasticWeightAveraging`: CALLBACK
`swa`) and a `ModelCheckpoint` every 2 steps on 2 CPU ranks, then tests the model and each checkpoint. Rank 0 writes
OUT_DIR/result.json: the test losses (the averaged model's, as the callback leaves it; each checkpoint's).

    PYTHONPATH=. python tests/weight_averaging_script.py OUT_DIR ld_ddp ema
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from tests.tiny_llama import tiny_llama

TOKENS = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))


class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def test_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("test_loss", outputs.loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    out, strategy, callback = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    averaging = EMAWeightAveraging(decay=0.9) if callback == "ema" else StochasticWeightAveraging(swa_lrs=1e-3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[averaging, ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)])
    model = FineTune()
    trainer.fit(model, DataLoader(TensorDataset(TOKENS), batch_size=2))
    tested = {"model": trainer.test(model, DataLoader(TensorDataset(TOKENS[:8]), batch_size=2))[0]["test_loss"]}
    for step in (2, 4):
        checkpoint = next(out.glob(f"*step={step}.ckpt"))
        tested[f"step {step}"] = trainer.test(FineTune(), DataLoader(TensorDataset(TOKENS[:8]), batch_size=2),
                                              ckpt_path=checkpoint)[0]["test_loss"]
    if trainer.global_rank == 0:
        (out / "result.json").write_text(json.dumps(tested))
