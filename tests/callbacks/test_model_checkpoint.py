"""Asked-for checkpoints are written when asked (lightning_dist/callbacks/model_checkpoint.py): with the default
config's `monitor: val_loss`, Lightning's ModelCheckpoint saved nothing, `last` included, before the first
validation, however often `every_n_train_steps` asked; a stop at step 19 of `every_n_train_steps=10` kept nothing."""

from __future__ import annotations

import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dist.callbacks import ModelCheckpoint
from tests.conftest import run_train


class Regression(L.LightningModule):
    """As users write one: logs `val_loss` at validations only."""

    def __init__(self, log_train_loss: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.log_train_loss = log_train_loss

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.layer(batch), batch.sum(-1, keepdim=True))
        if self.log_train_loss:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch), batch.sum(-1, keepdim=True)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(256, 4), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=4)


def fit(tmp_path, checkpoint, max_steps: int, val_check_interval: int, log_train_loss: bool = False
        ) -> list[tuple[str, int]]:
    """(file name, global step) of every save, in order."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=max_steps, val_check_interval=val_check_interval, check_val_every_n_epoch=None,
                        callbacks=[checkpoint], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    saves = []
    save = trainer.save_checkpoint

    def recorded(filepath, *args, **kwargs):
        saves.append((str(filepath).rsplit("/", 1)[-1], trainer.global_step))
        return save(filepath, *args, **kwargs)

    trainer.save_checkpoint = recorded
    trainer.fit(Regression(log_train_loss))
    return saves


def checkpoint(kind, tmp_path, **cadence):
    return kind(dirpath=tmp_path / "checkpoints", filename="step{step:06d}", monitor="val_loss", save_top_k=1,
                save_last=True, auto_insert_metric_name=False, enable_version_counter=False, **cadence)


def test_every_n_train_steps_saves_last_before_the_monitored_metric_exists(tmp_path):
    # Lightning's own: nothing before training ends, in 12 steps that reach no validation.
    lightnings = checkpoint(LightningModelCheckpoint, tmp_path / "lightning", every_n_train_steps=5)
    assert fit(tmp_path / "lightning", lightnings, 12, 100) == [("last.ckpt", 12)]
    ours = checkpoint(ModelCheckpoint, tmp_path, every_n_train_steps=5)
    assert fit(tmp_path, ours, 12, 100) == [("last.ckpt", 5), ("last.ckpt", 10), ("last.ckpt", 12)]


def test_a_training_metric_keeps_lightnings_top_k_of_the_step_saves(tmp_path):
    ours = checkpoint(ModelCheckpoint, tmp_path, every_n_train_steps=5)
    ours.monitor = "train_loss"
    lightnings = checkpoint(LightningModelCheckpoint, tmp_path / "lightning", every_n_train_steps=5)
    lightnings.monitor = "train_loss"
    assert fit(tmp_path, ours, 12, 100, log_train_loss=True) == \
        fit(tmp_path / "lightning", lightnings, 12, 100, log_train_loss=True)


def test_the_top_k_is_decided_at_validations_and_no_step_is_saved_twice(tmp_path):
    saves = fit(tmp_path, checkpoint(ModelCheckpoint, tmp_path, save_last_every_n_train_steps=5), 20, 10)
    # Step 10 and 20: validation saves the top-k and `last`; the cadence adds only the steps between.
    assert saves == [("last.ckpt", 5), ("step000010.ckpt", 10), ("last.ckpt", 10), ("last.ckpt", 15),
                     ("step000020.ckpt", 20), ("last.ckpt", 20)]


def train_losses(run) -> dict[int, str]:
    """{step label: train_loss} of the run's metrics.csv, each step once."""
    rows = [(int(row["step"]), row["train_loss"]) for row in run.csv_rows() if row.get("train_loss")]
    assert len({step for step, _ in rows}) == len(rows), rows
    return dict(rows)


# 60 steps of the default config, 4 sequences a rank instead of 16 (a third of the arithmetic): the checkpoint
# cadences, the stops and the resumed losses do not depend on the batch.
SIXTY_STEPS = ("trainer.max_steps=60", "test=false", "data.batch_size=4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = run_train(tmp_path_factory.mktemp("uninterrupted"), *SIXTY_STEPS)
    assert run.process.returncode == 0, run.output[-3000:]
    return run.summary["curves"]["train_loss"], train_losses(run)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code", "saved_at"), [
    (signal.SIGINT, 130, 50), (signal.SIGKILL, -9, 50),
    # A scheduler's notice: the preemption callback saves at the next logging step, with that step's row.
    # SIGUSR1 (SLURM's notice) takes SIGTERM's path: the extended matrix's, and tests/callbacks/test_preemption.py's.
    (signal.SIGTERM, 75, 55), pytest.param(signal.SIGUSR1, 75, 55, marks=pytest.mark.extended),
], ids=["SIGINT", "SIGKILL", "SIGTERM", "SIGUSR1"])
def test_a_stop_before_the_first_validation_keeps_the_default_cadences_last_save(signum, code, saved_at, tmp_path,
                                                                                  uninterrupted):
    """The default config's checkpoint cadences: a stop at step 53, before the first validation (step 100), keeps
    `last` of step 50 (or the preemption's), and `resume=run_dir` (a requeued job) continues from it with the
    uninterrupted run's losses; its metrics.csv then holds every logged step once, as the uninterrupted run's does."""
    stopped = run_train(tmp_path, *SIXTY_STEPS, "+callbacks.stop._target_=tests.probes.SignalAtStep",
                        "+callbacks.stop.global_step=53", f"+callbacks.stop.signal={signum.name}")
    assert stopped.process.returncode == code, stopped.output[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == saved_at
    if signum == signal.SIGINT:  # the stop line says what it kept (a preemption's line says what it saved)
        assert stopped.process.stderr.strip().splitlines()[-1] == (
            f"error: stopped by SIGINT, and the ranks it started with it; kept: {last} at step 50 (resume=true"
            " continues from it)")
    resumed = run_train(tmp_path, *SIXTY_STEPS, "resume=run_dir")
    assert resumed.process.returncode == 0, resumed.output[-3000:]
    assert f"resume=run_dir: resuming from {last}" in resumed.output
    curve, uninterrupted_csv = resumed.summary["curves"]["train_loss"], uninterrupted[1]
    # Rows are labelled with the global step before their batch: 54 is step 55's.
    resumed_labels = [label for label in ("54", "59") if int(label) >= saved_at]
    assert resumed.summary["global_step"] == 60 and sorted(curve, key=int) == resumed_labels
    assert curve == {step: uninterrupted[0][step] for step in resumed_labels}
    assert train_losses(resumed) == uninterrupted_csv and sorted(uninterrupted_csv) == list(range(4, 60, 5))
