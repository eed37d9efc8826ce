"""A monitored metric the model does not log is one line naming the key (lightning_dist/callbacks/monitored_metrics.py):
before the first training step where the sanity check shows it, else at the first validation with `last` saved.
Lightning raised a MisconfigurationException traceback at the first validation after training, saving nothing."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dist.callbacks import ModelCheckpoint
from lightning_dist.callbacks.monitored_metrics import MetricNotLogged, MonitoredMetrics
from tests.conftest import run_train


class Regression(L.LightningModule):
    """As users write one: `train_loss` each step, `val_loss` at validations."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.steps_trained = 0

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch), batch.sum(-1, keepdim=True))

    def training_step(self, batch, batch_idx):
        self.steps_trained += 1
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(256, 4), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=4)


def trainer(tmp_path, *callbacks: L.Callback, sanity_steps: int = 2) -> L.Trainer:
    named = {f"callbacks.{type(c).__name__.lower()}.monitor": c for c in callbacks}
    return L.Trainer(max_steps=6, val_check_interval=3, check_val_every_n_epoch=None, accelerator="cpu", devices=1,
                     callbacks=[MonitoredMetrics(named), *callbacks], logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=sanity_steps, default_root_dir=tmp_path)


class Plateau(Regression):
    """Its learning rate cut when `val/loss` stops falling; its validation logs `val_loss`."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss", "strict": False}}


def test_a_plateau_scheduler_watching_a_name_never_logged_stops_before_the_first_step(tmp_path):
    """With strict=False (before the first validation there is nothing to watch) it would never step, silently."""
    module = Plateau()
    with pytest.raises(MetricNotLogged, match=r"^ReduceLROnPlateau's monitor=val/loss: the model's validation logs no"
                       r" metric of that name; it logs val_loss \(did you mean val_loss\?\)$"):
        trainer(tmp_path).fit(module)
    assert module.steps_trained == 0


class EpochPlateau(Regression):
    """Its rate cut at the epoch's end on a training loss logged only there: after this run's validations."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_epoch_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "train_epoch_loss", "interval": "epoch"}}


def test_a_plateau_on_a_training_metric_of_the_epochs_end_trains_past_validations_within_the_epoch(tmp_path):
    module = EpochPlateau()
    trainer(tmp_path).fit(module)
    assert module.steps_trained == 6


@pytest.mark.parametrize("callback", [LightningModelCheckpoint, EarlyStopping])
def test_a_validation_name_the_model_does_not_log_stops_before_the_first_step(callback, tmp_path):
    module = Regression()
    with pytest.raises(MetricNotLogged) as stopped:
        trainer(tmp_path, callback(monitor="val/loss")).fit(module)
    key = f"callbacks.{callback.__name__.lower()}.monitor"
    assert str(stopped.value) == (f"{key}=val/loss: the model's validation logs no metric of that name; it logs "
                                  "val_loss (did you mean val_loss?)")
    assert module.steps_trained == 0
    assert stopped.value.exit_code == 2


def test_a_name_that_may_be_a_training_metric_waits_for_the_first_validation_and_saves_last(tmp_path):
    module = Regression()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", monitor="train/loss", save_last=True)
    with pytest.raises(MetricNotLogged) as stopped:
        trainer(tmp_path, checkpoint).fit(module)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert str(stopped.value) == (
        "callbacks.modelcheckpoint.monitor=train/loss: the model has logged no metric of that name by the validation"
        " at step 3; it logs train_loss, val_loss (did you mean train_loss?); saved"
        f" {last}: fix the key and pass ckpt_path={last} to continue from it")
    assert module.steps_trained == 3
    assert torch.load(last, weights_only=False)["global_step"] == 3


def test_without_a_sanity_check_a_missing_validation_name_stops_at_the_first_validation(tmp_path):
    module = Regression()
    with pytest.raises(MetricNotLogged, match=r"^callbacks.earlystopping.monitor=val_acc: the model has logged no "
                       r"metric of that name by the validation at step 3; it logs train_loss, val_loss$"):
        trainer(tmp_path, EarlyStopping(monitor="val_acc"), sanity_steps=0).fit(module)
    assert module.steps_trained == 3


@pytest.mark.parametrize("callback", [
    LightningModelCheckpoint(monitor="train_loss"),  # a training metric, found at the first validation
    LightningModelCheckpoint(monitor="step", mode="max"),  # Lightning's own candidates
    EarlyStopping(monitor="val/loss", strict=False),  # Lightning only warns: left to it
    LightningModelCheckpoint(monitor=None),
])
def test_what_is_logged_or_not_required_trains_to_the_end(callback, tmp_path):
    module = Regression()
    trainer(tmp_path, callback).fit(module)
    assert module.steps_trained == 6


def test_validate_alone_is_left_to_lightning(tmp_path):
    checkpoint = LightningModelCheckpoint(monitor="val/loss")
    metrics = trainer(tmp_path, checkpoint, sanity_steps=0).validate(Regression(), verbose=False)
    assert list(metrics[0]) == ["val_loss"]


def test_lightning_hydra_templates_monitor_as_typed_is_one_line_before_the_first_step(tmp_path):
    """As a user of lightning-hydra-template types it, from a fresh directory: exit 2, one line, no traceback."""
    run = run_train(tmp_path / "run", "callbacks.model_checkpoint.monitor=val/loss", "trainer.max_steps=6")
    errors = [line for line in run.process.stderr.splitlines() if "error:" in line]
    assert run.process.returncode == 2, run.output[-3000:]
    assert [line[line.index("error:"):] for line in errors] == [
        "error: callbacks.model_checkpoint.monitor=val/loss: the model's validation logs no metric of that name; it"
        " logs val_loss, val_ppl (did you mean val_loss?)"]
    assert "Traceback" not in run.output
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert [row for row in run.csv_rows() if row.get("train_loss")] == []


def test_a_late_stop_keeps_what_trained_and_its_ckpt_path_continues_from_it(tmp_path):
    typed = ("trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.devices=1")
    stopped = run_train(tmp_path / "run", "callbacks.model_checkpoint.monitor=loss", *typed)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert stopped.process.returncode == 2, stopped.output[-3000:]
    assert stopped.process.stderr.strip().splitlines()[-1].endswith(
        "error: callbacks.model_checkpoint.monitor=loss: the model has logged no metric of that name by the validation"
        f" at step 3; it logs train_loss, val_loss, val_ppl (did you mean val_loss?); saved {last}: fix the key and"
        f" pass ckpt_path={last} to continue from it")
    assert "Traceback" not in stopped.output
    assert torch.load(last, weights_only=False)["global_step"] == 3
    continued = run_train(tmp_path / "continued", "callbacks.model_checkpoint.monitor=val_loss", *typed,
                          f"ckpt_path={last}")
    assert continued.process.returncode == 0, continued.output[-3000:]
    # Steps 4 to 6 only (Lightning runs no sanity check mid-epoch): the validation at step 6 (csv step 5), its top-k.
    assert sorted(continued.val_losses()) == [5]
    assert sorted(path.name for path in (tmp_path / "continued" / "checkpoints").iterdir()) == [
        "last.ckpt", "step000006.ckpt"]
