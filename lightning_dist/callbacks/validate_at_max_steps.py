"""Validate (and so checkpoint) when `max_steps` ends training between two validation intervals."""

from __future__ import annotations

import lightning as L
from typing_extensions import override


class ValidateAtMaxSteps(L.Callback):
    """Lightning stops at `max_steps` without validating unless the step falls on `val_check_interval`, which
    leaves a run without its final validation loss and without a checkpoint of its final weights. Flagging the
    stop one hook earlier makes Lightning's loop run validation before it exits, as it does for early stopping."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
