"""Lightning's ModelCheckpoint, where a step cadence saves `last` whatever the monitor.

With a `monitor` (the default config's `val_loss`), Lightning's `every_n_train_steps` defers every save, `last`
included, until the monitored metric exists: a run stopped before its first validation kept nothing, however
often the config asked for saves. Once the metric exists, it ranks the step cadence's saves by the metric of the
latest validation, and no longer saves the top-k at validations at all. Here the two are kept apart:

- with a `monitor` and `save_last=true`, `every_n_train_steps` saves `last` every N optimizer steps, and the
  monitored top-k is decided at each validation, as without a cadence;
- without a monitor, or with `save_last` false or "link", Lightning's own behaviour (the cadence saves the top-k
  of the newest checkpoints).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from typing_extensions import override

from lightning_dist._compat.lightning import save_last_now


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (the same arguments), where `every_n_train_steps` with a `monitor` saves `last`
    on its cadence from the first step, and the monitored top-k at validations."""

    def __init__(self, *, every_n_train_steps: int | None = None, **kwargs: Any) -> None:
        splits = kwargs.get("monitor") is not None and kwargs.get("save_last") is True and bool(every_n_train_steps)
        self.last_every_n_train_steps = every_n_train_steps if splits else None
        super().__init__(every_n_train_steps=None if splits else every_n_train_steps, **kwargs)
        self._due_at: int | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        every = self.last_every_n_train_steps
        if every and trainer.global_step > 0 and trainer.global_step % every == 0:
            # Saved as the next batch starts: a validation that runs after this batch saves `last` itself (with the
            # top-k), and the cadence then has nothing to add.
            self._due_at = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_start(trainer, pl_module, *args, **kwargs)
        if self._due_at is not None and self._due_at == trainer.global_step:
            save_last_now(self, trainer)
        self._due_at = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # Lightning's saves `last` here only if nothing was saved before
        if self.last_every_n_train_steps:
            save_last_now(self, trainer)  # the final weights, where the cadence's last save was an earlier step
