"""Two ways users accumulate gradients, under a plain `L.Trainer` on 2 CPU ranks. Writes each rank's losses and
the step count to OUT_DIR/rank<N>.json.

    python tests/accumulation_script.py OUT_DIR ld_deepspeed_stage_2 manual     # by hand, as Lightning's docs do it:
        # two backwards a step, clipping by `self.clip_gradients`, its own scheduler step; 1 epoch of 16 batches
    python tests/accumulation_script.py OUT_DIR ld_deepspeed_stage_2 automatic  # accumulate_grad_batches=3 over 10
        # batches an epoch, 3 epochs: Lightning steps at each epoch's last batch too (4 steps an epoch)
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  (registers the ld_* names)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Regressor(L.LightningModule):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.losses = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AccumulatingRegressor(L.LightningModule):
    def __init__(self, width=32, depth=4, accumulate=2):
        super().__init__()
        self.automatic_optimization = False
        self.accumulate = accumulate
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.losses = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(loss.item())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)]


if __name__ == "__main__":
    out_dir, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    L.seed_everything(0)
    x = torch.randn(512 if mode == "manual" else 320, 32)
    data = DataLoader(TensorDataset(x, torch.tanh(x.sum(dim=1, keepdim=True) / 4)), batch_size=16)
    model = AccumulatingRegressor() if mode == "manual" else Regressor()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1 if mode == "manual" else 3,
                        accumulate_grad_batches=1 if mode == "manual" else 3, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(model, data)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(
        {"global_step": trainer.global_step, "losses": model.losses}))
