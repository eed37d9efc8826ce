"""A model and data of your own, as `train.py` takes them: a LightningModule and a LightningDataModule, named by
`_target_` in conf/model/regressor.yaml and conf/data/regression.yaml (see this folder's README)."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ResidualBlock(nn.Module):
    """The repeated layer: FSDP shards each one as a unit, activation checkpointing recomputes each one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Regressor(L.LightningModule):
    """Predicts one number from `width` features; logs train_loss, val_loss (which the checkpoint watches) and
    test_loss. `optimizer` is what train.py's `optimizer=` group gives (a partial that takes the parameters)."""

    def __init__(self, width: int = 64, depth: int = 4, optimizer: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], name: str) -> torch.Tensor:
        features, target = batch
        loss = nn.functional.mse_loss(self(features), target)
        self.log(name, loss, prog_bar=name == "train_loss", sync_dist=name != "train_loss")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.step(batch, "train_loss")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.step(batch, "val_loss")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.step(batch, "test_loss")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return self.optimizer_factory(params=self.parameters())


class RegressionData(L.LightningDataModule):
    """Features from a fixed seed and a smooth function of them as the target: every rank makes the same data, and
    the `DistributedSampler` Lightning adds gives each rank its share."""

    def __init__(self, width: int = 64, samples: int = 4096, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.width, self.samples, self.batch_size, self.seed = width, samples, batch_size, seed

    def setup(self, stage: str | None = None) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        features = torch.randn(self.samples, self.width, generator=generator)
        direction = torch.randn(self.width, generator=generator) / self.width**0.5
        target = torch.tanh(features @ direction)
        split = [int(0.8 * self.samples), int(0.9 * self.samples)]
        self.train, self.val, self.test = (
            TensorDataset(features[a:b], target[a:b]) for a, b in zip([0, *split], [*split, self.samples])
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)
