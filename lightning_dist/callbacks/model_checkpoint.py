"""Lightning's ModelCheckpoint, where asked-for saves of `last` happen whatever the monitor.

With a `monitor` the run has not logged yet (the default config's `val_loss`, before the first validation),
Lightning's `every_n_train_steps` defers every save, `last` included, until the metric exists: a run stopped
before its first validation kept nothing, however often the config asked for saves. Here:

- `save_last_every_n_train_steps=N` saves `last` every N optimizer steps from the first, and leaves the top-k to
  `monitor` and Lightning's own triggers (each validation, by default);
- `every_n_train_steps=N` keeps Lightning's meaning (the top-k of the saves every N steps), and while the monitored
  metric does not exist yet, saves `last` on that cadence where Lightning's would save nothing.

It also says which optimizer step `best_model_path` holds (`best_model_step`): where that is the run's last, the
model's weights are the best checkpoint's, and testing it needs no load.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from typing_extensions import override

from lightning_dist._compat.lightning import save_last_now, validation_follows


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the same arguments), plus `save_last_every_n_train_steps` (inert with
    `save_last` off); `every_n_train_steps` saves `last` even before the monitored metric exists."""

    def __init__(self, *args: Any, save_last_every_n_train_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if save_last_every_n_train_steps is not None and (
                not isinstance(save_last_every_n_train_steps, int) or save_last_every_n_train_steps < 1):
            raise ValueError(f"save_last_every_n_train_steps={save_last_every_n_train_steps}: give a number of"
                             " optimizer steps, 1 or more, or null")
        self.save_last_every_n_train_steps = save_last_every_n_train_steps
        self._top_k_every_n_train_steps = kwargs.get("every_n_train_steps")
        self._saved_on_cadence = False
        self.best_model_step: int | None = None  # the optimizer step whose weights best_model_path holds

    def _note_best(self, trainer: L.Trainer, before: str) -> None:
        if self.best_model_path and self.best_model_path != before:
            self.best_model_step = trainer.global_step

    def _last_is_due(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        if step == 0 or not self.save_last:
            return False
        own_cadence = self.save_last_every_n_train_steps and step % self.save_last_every_n_train_steps == 0
        deferred = (self._top_k_every_n_train_steps and step % self._top_k_every_n_train_steps == 0
                    and self.monitor is not None and self.monitor not in trainer.callback_metrics)
        return bool(own_cadence or deferred)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        before = self.best_model_path
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        self._note_best(trainer, before)
        # A validation after this batch saves `last` itself, with the top-k (and a save here would keep it from
        # deciding the top-k: ModelCheckpoint saves once per step).
        if self._last_is_due(trainer) and not validation_follows(trainer):
            self._saved_on_cadence |= save_last_now(self, trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # Lightning's saves `last` here only if nothing was saved before
        if self._saved_on_cadence:
            save_last_now(self, trainer)  # the final weights, where the cadence's last save was an earlier step

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        before = self.best_model_path
        super().on_train_epoch_end(trainer, pl_module)
        self._note_best(trainer, before)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        before = self.best_model_path
        super().on_validation_end(trainer, pl_module)
        self._note_best(trainer, before)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_model_step": self.best_model_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_model_step = state_dict.get("best_model_step")  # with best_model_path, which Lightning restores
