"""A user's script that finds its learning rate with Lightning's Tuner, then trains with it, on CPU ranks. Rank 0
writes OUT_DIR/result.json: the suggestion, the module's learning rate after the search, the next fit's losses and
what the search left in the Trainer's root directory.

    PYTHONPATH=. python tests/lr_find_script.py OUT_DIR ld_fsdp
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from tests.tiny_llama import tiny_llama


class FineTune(L.LightningModule):
    def __init__(self, learning_rate: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.learning_rate = learning_rate
        self.model = tiny_llama()
        self.losses = []

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        self.losses.append(outputs.loss.item())
        return outputs.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


if __name__ == "__main__":
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=out / "root")
    model = FineTune()
    finder = Tuner(trainer).lr_find(model, train_dataloaders=loader, num_training=30)
    model.losses = []
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        left = sorted(path.name for path in (out / "root").iterdir()) if (out / "root").exists() else []
        (out / "result.json").write_text(json.dumps({"suggestion": finder.suggestion(), "lr": model.learning_rate,
                                                     "losses": model.losses, "left": left}))
