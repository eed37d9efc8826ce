"""Lightning's Tuner under our strategies.

`Tuner(trainer).lr_find(model)` runs a search fit (its LearningRateFinder callback: a checkpoint saved, the learning
rate swept by a scheduler of its own, the checkpoint restored and removed), which ends on every rank by Lightning's
`_TunerExitException`; the user's script then goes on, usually to `trainer.fit`. Under ddp and fsdp it finds what
Lightning's ddp finds (tests/strategies/test_learning_rate_finder.py); where an engine cannot run the search, the
launch stops in one line before any rank starts.
"""

from __future__ import annotations

from typing import Any


def refuse_learning_rate_finder(trainer: Any, why: str) -> None:
    """A ValueError where `trainer` would run `lr_find`'s search: `why` says what the engine cannot do."""
    from lightning.pytorch.callbacks import LearningRateFinder

    if any(isinstance(callback, LearningRateFinder) for callback in getattr(trainer, "callbacks", [])):
        raise ValueError(f"Tuner.lr_find (LearningRateFinder) {why}: find the learning rate under ld_ddp or ld_fsdp"
                         " (the same model, the same lr), then train under this strategy")
