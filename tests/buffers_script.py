"""A user's module with BatchNorm, whose running statistics each rank keeps from its own batches (no SyncBatchNorm),
trained then tested on its checkpoint in one script. Writes OUT_DIR/rank<N>.json: the buffers each rank held when it
saved, and those it tests with.

    python tests/buffers_script.py OUT_DIR ld_fsdp
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  (registers the ld_ strategies)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))

    def buffers_now(self) -> dict[str, list[float]]:
        return {name: buffer.float().tolist() for name, buffer in self.net.named_buffers() if buffer.is_floating_point()}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def on_save_checkpoint(self, checkpoint):
        self.saved_buffers = self.buffers_now()

    def on_test_start(self):
        self.tested_buffers = self.buffers_now()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out_dir: str, strategy: str) -> None:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Classifier()
    trainer.fit(model, data)
    trainer.save_checkpoint(Path(out_dir, "trained.ckpt"))
    trainer.test(model, data, ckpt_path=Path(out_dir, "trained.ckpt"))
    result = {"saved": model.saved_buffers, "tested": model.tested_buffers}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
