"""Checkpoints that work the same for every strategy: formats, consolidation to one plain file."""

from lightning_dist.checkpoints.consolidate import consolidate_checkpoint, load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError, checkpoint_format
from lightning_dist.checkpoints.gather import gather_full_state_dict

__all__ = ["CheckpointError", "checkpoint_format", "consolidate_checkpoint", "gather_full_state_dict", "load_consolidated"]
