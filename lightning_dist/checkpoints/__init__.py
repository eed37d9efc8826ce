"""Checkpoints that work the same for every strategy: formats, consolidation to one plain file."""

from lightning_dist.checkpoints.consolidate import consolidate_checkpoint, load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError, checkpoint_format
from lightning_dist.checkpoints.gather import gather_full_state_dict
from lightning_dist.checkpoints.whole import check_whole, is_whole

__all__ = [
    "CheckpointError", "check_whole", "checkpoint_format", "consolidate_checkpoint", "gather_full_state_dict", "is_whole",
    "load_consolidated",
]
