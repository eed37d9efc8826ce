"""Checkpoints that work the same for every strategy: formats, consolidation to one plain file."""

from typing import Any

from lightning_dist.checkpoints.formats import CheckpointError, checkpoint_format
from lightning_dist.checkpoints.gather import gather_full_state_dict
from lightning_dist.checkpoints.whole import check_whole, is_whole

__all__ = [
    "CheckpointError",
    "check_whole",
    "checkpoint_format",
    "consolidate_checkpoint",
    "gather_full_state_dict",
    "is_whole",
    "load_consolidated",
    "load_from_checkpoint",
]
# Loaded on first use: imported here, `python -m lightning_dist.checkpoints.consolidate` would find its own module
# in sys.modules before running it (runpy's RuntimeWarning).
_CONSOLIDATE = ("consolidate_checkpoint", "load_consolidated", "load_from_checkpoint")


def __getattr__(name: str) -> Any:
    if name in _CONSOLIDATE:
        from lightning_dist.checkpoints import consolidate

        return getattr(consolidate, name)
    raise AttributeError(f"module 'lightning_dist.checkpoints' has no attribute {name!r}")
