"""Ten Gaussian clusters in 64 dimensions, drawn from a fixed seed: a classification task that needs no download
(the template trains MNIST)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class ClustersDataModule(L.LightningDataModule):
    def __init__(self, samples: int = 4096, features: int = 64, classes: int = 10, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        centres = torch.randn(hp.classes, hp.features, generator=generator)
        labels = torch.randint(0, hp.classes, (hp.samples,), generator=generator)
        points = centres[labels] + 1.5 * torch.randn(hp.samples, hp.features, generator=generator)
        train, val = int(0.8 * hp.samples), int(0.1 * hp.samples)  # the rest: the test set
        self.train_set = TensorDataset(points[:train], labels[:train])
        self.val_set = TensorDataset(points[train:train + val], labels[train:train + val])
        self.test_set = TensorDataset(points[train + val:], labels[train + val:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)
