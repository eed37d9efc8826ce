"""A checkpoint saved as a run stopped in the middle of an epoch (`max_steps`, `max_time`, a callback's
`trainer.should_stop`), as Lightning writes it: Lightning runs the epoch-end hooks as it stops and counts the epoch
done. A resume bounded by epochs starts the next epoch from a save made in those hooks or after them; one bounded by
steps, from a save after them, starts the next epoch at the stopped one's batch. `reopen_epoch_stopped_early` makes
its loop state that of a save after the same batch, and leaves every other checkpoint as it is; Lightning itself then
finishes the stopped epoch. In one process, Lightning's own single-device strategy, 5 batches an epoch."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist._compat.lightning import close_ended_epoch, reopen_epoch_stopped_early


class Recorded(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.steps: list[tuple[int, int]] = []  # (epoch, batch_idx) of each step

    def training_step(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx))
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(10.0).unsqueeze(1)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveAtTheEnd(Callback):
    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def fit(tmp_path, max_steps: int = -1, callbacks=(), ckpt_path=None, module=None) -> Recorded:
    module = module or Recorded()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=list(callbacks))
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run stopped by max_steps=8: after 3 of epoch 1's 5 batches."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    every_2_steps = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    epoch_ends = ModelCheckpoint(dirpath=tmp_path, filename="end-{epoch}", save_top_k=-1,
                                 save_on_train_epoch_end=True)
    fit(tmp_path, 8, [every_2_steps, epoch_ends, SaveAtTheEnd(tmp_path / "after.ckpt")])
    return {path.name: torch.load(path, weights_only=False) for path in tmp_path.glob("*.ckpt")}


def fit_progress(checkpoint) -> dict:
    return checkpoint["loops"]["fit_loop"]["epoch_progress"]


@pytest.mark.parametrize("name", ["end-epoch=1.ckpt", "after.ckpt"])
def test_a_save_at_the_stop_is_reopened_as_the_save_after_its_batch(saved, name):
    checkpoint = copy.deepcopy(saved[name])
    assert checkpoint["global_step"] == 8
    assert reopen_epoch_stopped_early(checkpoint) == (1, 3)
    # The save after the same batch (every 2 steps: at step 8, after epoch 1's batch 2) holds this epoch progress.
    assert fit_progress(checkpoint) == fit_progress(saved["epoch=1-step=8.ckpt"])


@pytest.mark.parametrize("name", ["end-epoch=0.ckpt", "epoch=0-step=2.ckpt", "epoch=1-step=6.ckpt",
                                  "epoch=1-step=8.ckpt"])
def test_saves_at_an_epoch_s_end_or_in_its_middle_are_not_reopened(saved, name):
    checkpoint = copy.deepcopy(saved[name])
    assert reopen_epoch_stopped_early(checkpoint) is None
    assert checkpoint == saved[name]


@pytest.mark.parametrize("name", ["end-epoch=1.ckpt", "after.ckpt"])
def test_lightning_finishes_the_reopened_epoch(saved, name, tmp_path):
    """Resumed to the end of epoch 2 (max_epochs=3, as a job continued after `max_time` is)."""
    checkpoint = copy.deepcopy(saved[name])
    reopen_epoch_stopped_early(checkpoint)
    torch.save(checkpoint, tmp_path / "reopened.ckpt")
    assert fit(tmp_path, ckpt_path=tmp_path / "reopened.ckpt").steps == [(1, 3), (1, 4), *((2, b) for b in range(5))]
    # As saved, Lightning goes on with epoch 2: epoch 1's last 2 batches are never read.
    torch.save(saved[name], tmp_path / "as_saved.ckpt")
    assert fit(tmp_path, ckpt_path=tmp_path / "as_saved.ckpt").steps == [(2, b) for b in range(5)]


class StepsAnEpochSchedule(Recorded):
    """Records the learning rate of each step too: an `interval: "epoch"` schedule halves it at each epoch's end."""

    def training_step(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx, self.optimizers().param_groups[0]["lr"]))
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "epoch"}]


@pytest.fixture(scope="module")
def saved_at_an_epoch_end(tmp_path_factory):
    """A run of max_steps=5: epoch 0 whole, saved in its epoch-end hooks and after them."""
    tmp_path = tmp_path_factory.mktemp("epoch_end")
    epoch_ends = ModelCheckpoint(dirpath=tmp_path, filename="end-{epoch}", save_top_k=-1,
                                 save_on_train_epoch_end=True)
    every_5_steps = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    fit(tmp_path, 5, [epoch_ends, every_5_steps, SaveAtTheEnd(tmp_path / "after.ckpt")], module=StepsAnEpochSchedule())
    return {path.name: torch.load(path, weights_only=False) for path in tmp_path.glob("*.ckpt")}


@pytest.mark.parametrize("max_steps", [8, -1])
@pytest.mark.parametrize("name", ["end-epoch=0.ckpt", "after.ckpt"])
def test_a_save_at_an_epoch_s_end_resumes_with_the_next_epoch_s_first_batch(saved_at_an_epoch_end, name, max_steps,
                                                                            tmp_path):
    """Resumed as saved under `max_steps=8`, Lightning trained a batch 5 of a 5-batch epoch and halved the
    learning rate once more: [(0, 5, 0.5), (1, 0, 0.25), ...] from the hooks' save, [(1, 5, 0.5), (2, 0, 0.25), ...]
    from the one after them."""
    checkpoint = copy.deepcopy(saved_at_an_epoch_end[name])
    assert close_ended_epoch(checkpoint) == 0
    torch.save(checkpoint, tmp_path / "closed.ckpt")
    resumed = fit(tmp_path, max_steps, ckpt_path=tmp_path / "closed.ckpt", module=StepsAnEpochSchedule())
    assert resumed.steps[:3] == [(1, 0, 0.5), (1, 1, 0.5), (1, 2, 0.5)]


@pytest.mark.parametrize("name", ["epoch=0-step=5.ckpt", "epoch=0-step=2.ckpt", "epoch=1-step=8.ckpt",
                                  "end-epoch=1.ckpt"])
def test_saves_after_a_batch_or_in_an_epoch_are_not_closed(saved, saved_at_an_epoch_end, name):
    """The save after the epoch's last batch (Lightning resumes it right), one in the middle of an epoch, and one at a
    stop in the middle of an epoch (reopened instead)."""
    checkpoint = copy.deepcopy({**saved, **saved_at_an_epoch_end}[name])
    assert close_ended_epoch(checkpoint) is None
