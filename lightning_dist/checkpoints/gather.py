"""The full, unsharded weights of a running model, whatever the strategy (a collective: call it on every rank)."""

from __future__ import annotations

import torch
from torch import nn


def gather_full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank gets the complete state dict on CPU: FSDP2 shards and ZeRO-3 partitions are gathered."""
    parameters = list(module.parameters())
    if any(hasattr(p, "ds_tensor") for p in parameters):  # DeepSpeed ZeRO-3 placeholders
        from lightning_dist._compat.deepspeed import zero3_gathered

        with zero3_gathered(parameters):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for name, value in _plain_names(module.state_dict()).items()
    }


def plain_name(name: str) -> str:
    # Activation checkpointing inserts a wrapper into every block's parameter names; checkpoints never carry it.
    return name.replace("._checkpoint_wrapped_module", "")


def _plain_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {plain_name(k): v for k, v in state_dict.items()}
