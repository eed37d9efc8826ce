"""The full, unsharded weights of a running model, whatever the strategy (a collective: call it on every rank)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallel.pipeline_split import stage_group


def gather_full_state_dict(module: nn.Module, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Every rank gets the complete state dict on CPU: FSDP2 shards and ZeRO-3 partitions are gathered, and under
    pipeline stages every stage's part. `names`: only those entries (only their parameters are gathered)."""
    keep = (lambda name: True) if names is None else (lambda name: plain_name(name) in names)
    parameters = [p for name, p in module.named_parameters() if keep(name)]
    if any(hasattr(p, "ds_tensor") for p in module.parameters()):  # DeepSpeed ZeRO-3 placeholders
        from lightning_dist._compat.deepspeed import zero3_gathered

        with zero3_gathered(parameters):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if keep(k)}
    from torch.distributed.tensor import DTensor

    held = {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for name, value in _plain_names(module.state_dict()).items() if keep(name)
    }
    return every_stage(module, held)


def every_stage(module: nn.Module, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`held` with the other pipeline stages' entries, in stage order, where `module` is split into stages (a stage
    holds only its part: its adapters alone were written, accelerate #4206's loss in another form)."""
    group = stage_group(module)
    if group is None:
        return held
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, held, group=group)
    return {name: value for stage in stages for name, value in stage.items()}


def plain_name(name: str) -> str:
    # Activation checkpointing inserts a wrapper into every block's parameter names; checkpoints never carry it.
    return name.replace("._checkpoint_wrapped_module", "")


def _plain_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {plain_name(k): v for k, v in state_dict.items()}
