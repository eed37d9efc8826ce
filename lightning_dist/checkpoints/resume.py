"""Resuming from a checkpoint that another strategy (or world size) wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError, checkpoint_format
from lightning_dist.checkpoints.safe_load import vet_checkpoint


def load_for_resume(path: str | Path, native_formats: set[str], weights_only: bool | None) -> dict[str, Any] | None:
    """None when `path` is in one of the strategy's own formats (let it load as usual, once vetted); otherwise
    the checkpoint consolidated into one plain dict (weights, loops, and optimizer state by parameter name).

    `weights_only` is Lightning's: unless the user passed False, every pickle in the checkpoint must hold data
    only (safe_load.py), whichever library reads it afterwards.
    """
    trusted = weights_only is False
    if checkpoint_format(path) in native_formats:
        if not trusted:
            vet_checkpoint(path)
        return None
    return load_consolidated(path, trusted)


def restore_optimizer_by_name(module: torch.nn.Module, optimizers: list, checkpoint: dict[str, Any]) -> None:
    """Load per-parameter-name optimizer state (from `load_for_resume`) into the live optimizer, whatever its
    parameter groups or sharding: torch's state-dict API maps names onto plain and FSDP2 parameters alike."""
    state_by_name = checkpoint.pop("optimizer_state_by_name", None)
    if not state_by_name or len(optimizers) != 1:
        rank_zero_warn("The checkpoint's optimizer state cannot be mapped onto this optimizer: it starts afresh.")
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    options = StateDictOptions(full_state_dict=True)
    current = get_optimizer_state_dict(module, optimizer, options=options)  # param_groups keyed by name
    names = [name for group in current["param_groups"] for name in group["params"]]
    missing = [name for name in names if name not in state_by_name]
    if missing:
        raise CheckpointError(f"ckpt_path: the checkpoint has no optimizer state for {', '.join(missing[:3])}")
    current["state"] = {name: state_by_name[name] for name in names}
    set_optimizer_state_dict(module, optimizer, optim_state_dict=current, options=options)
