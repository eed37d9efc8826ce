"""The loggers' step labels after a resume: the global step of the losses in each row, as in a run never resumed."""

from __future__ import annotations

from typing import Any

from lightning_dist._compat.lightning import StrategyMixin, label_logged_rows_by_global_step


class LogsGlobalSteps(StrategyMixin):
    """Strategy mixin (before the Lightning strategy in the bases): each training batch's logged row is labelled
    with the global step before it, however the run was resumed (`label_logged_rows_by_global_step`)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        label_logged_rows_by_global_step(self.lightning_module.trainer)  # type: ignore[union-attr]  # in training
