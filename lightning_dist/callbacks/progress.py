"""A progress bar that counts the run's optimizer steps when `trainer.max_steps` bounds it.

Lightning's bar counts the batches of each epoch and starts again at every epoch: a 300-step run over a short
dataset showed three bars and never how far the run was. This one shows `epoch 1: step 120/300` on one bar.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_dist._compat.lightning import read_bar_values_at_refresh

STEP_BAR_FORMAT = (
    "{desc}step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
)


class StepProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, over optimizer steps (`trainer.global_step`, so accumulation counts once per step and a
    resumed run starts where it stopped) when the run is step-bounded; per epoch, as Lightning's, otherwise. The
    values it shows are read on the host when it redraws, not after every batch."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        read_bar_values_at_refresh(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        if _step_bounded(trainer):
            self.train_progress_bar.bar_format = STEP_BAR_FORMAT
            self.train_progress_bar.set_description(f"epoch {trainer.current_epoch}", refresh=False)  # not "Training"
            self.train_progress_bar.reset(total=trainer.max_steps)
            self.train_progress_bar.initial = trainer.global_step
            self.train_progress_bar.n = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not _step_bounded(trainer):
            return super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"epoch {trainer.current_epoch}", refresh=False)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not _step_bounded(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, step = self.train_progress_bar, trainer.global_step
        if self._should_update(step, bar.total) and not bar.disable:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # The run ends with a line of its own (the error, or the stop): on a line after the bar's, not appended to it.
        for bar in (
            self._train_progress_bar,
            self._val_progress_bar,
            self._test_progress_bar,
            self._predict_progress_bar,
        ):
            if bar is not None and not bar.disable:
                bar.close()


def _step_bounded(trainer: L.Trainer) -> bool:
    return trainer.max_steps is not None and trainer.max_steps > 0


def refreshes_after(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether the trainer's progress bar redraws its values after this training batch (and so reads them on the
    host). Lightning's TQDM bars redraw every `refresh_rate` batches (this one: optimizer steps); its Rich bar after
    every batch."""
    bar = trainer.progress_bar_callback
    if bar is None or not getattr(bar, "is_enabled", True):
        return False
    if isinstance(bar, StepProgressBar) and _step_bounded(trainer):
        count, total = trainer.global_step + 1, trainer.max_steps
    elif isinstance(bar, TQDMProgressBar):
        count, total = batch_idx + 1, bar.train_progress_bar.total
    else:
        return True
    return bool(bar.refresh_rate) and (count % bar.refresh_rate == 0 or count == total)
