"""A LightningModule in lightning-hydra-template's shape (`src/models/mnist_module.py`): the network, a partial
optimizer and a partial scheduler come from Hydra; torchmetrics keep loss and accuracy; ReduceLROnPlateau steps
on `val/loss` once per epoch. Nothing in it knows which strategy runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class DenseNet(nn.Module):
    """The template's SimpleDenseNet pattern: Linear, BatchNorm and ReLU layers in an nn.Sequential."""

    def __init__(self, input_size: int = 64, hidden_size: int = 128, output_size: int = 10) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Classifier(L.LightningModule):
    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None,
        num_classes: int = 10,
        report_path: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc, self.val_acc = MulticlassAccuracy(num_classes), MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # The sanity check's validation batches must not count towards the first epoch's metrics.
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self._step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, preds, targets = self._step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.val_loss.compute()))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, preds, targets = self._step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1},
        }

    def on_train_end(self) -> None:
        """What the plateau scheduler saw, for the recipe's README and test: how often it stepped, the best
        `val/loss` it holds, and the learning rate it left."""
        if self.hparams.report_path is None or not self.trainer.is_global_zero:
            return
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        report = {
            "strategy": type(self.trainer.strategy).__name__,
            "scheduler": type(scheduler).__name__,
            "scheduler_steps": scheduler.last_epoch,
            "scheduler_best": scheduler.best,
            "val_losses": self.val_losses,
            "lr": [group["lr"] for group in self.trainer.optimizers[0].param_groups],
        }
        Path(self.hparams.report_path).write_text(json.dumps(report))
