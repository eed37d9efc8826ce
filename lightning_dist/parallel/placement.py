"""Where a rank's parameters and optimizer state actually are: evidence that sharding and offload happened."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist._compat.lightning import unwrapped_optimizer
from lightning_dist._compat.torch import CheckpointWrapper, fully_sharded_parameters, fully_sharded_units


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank stores, for plain, FSDP2 (DTensor) and DeepSpeed ZeRO-3 parameters."""
    if hasattr(param, "ds_tensor"):  # ZeRO-3: `param` itself is an empty placeholder between uses
        return param.ds_tensor
    return param.to_local() if isinstance(param, DTensor) else param


def parameter_numel(module: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model)."""
    local = sum(local_part(p).numel() for p in module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    return local, total


def _base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # Lightning wraps in LightningOptimizer (`_optimizer`); DeepSpeed's ZeRO optimizers hold the torch one.
    optimizer = unwrapped_optimizer(optimizer)
    return getattr(optimizer, "optimizer", optimizer)


def master_weights(optimizer: Any) -> list[torch.Tensor]:
    """What the optimizer updates: DeepSpeed ZeRO's fp32 partitions, or a torch optimizer's parameters."""
    optimizer = unwrapped_optimizer(optimizer)
    # ZeRO-3 lends its partitions to the torch optimizer only while stepping; ZeRO-1/2 keep them here too.
    for attribute in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        if hasattr(optimizer, attribute):
            return list(getattr(optimizer, attribute))
    return [p for group in _base_optimizer(optimizer).param_groups for p in group["params"]]


def placement_report(module: nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    """A JSON-friendly summary of one rank: parameter counts, devices, optimizer and its state's devices."""
    local, total = parameter_numel(module)
    base_optimizers = [_base_optimizer(o) for o in optimizers]
    state_devices = {
        value.device.type
        for optimizer in base_optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }
    master_dtypes = {str(tensor.dtype) for optimizer in optimizers for tensor in master_weights(optimizer)}
    return {
        "parameters_local": local,
        "parameters_total": total,
        "parameter_devices": sorted({local_part(p).device.type for p in module.parameters()}),
        "optimizer_classes": [type(o).__name__ for o in base_optimizers],
        "optimizer_state_devices": sorted(state_devices),
        # The dtype parameters are stored in, and the dtype of what the optimizer updates (the master weights).
        "parameter_dtypes": sorted({str(local_part(p).dtype) for p in module.parameters()}),
        "master_dtypes": sorted(master_dtypes),
        "fsdp_gathered_dtypes": sorted({str(p.param_dtype or p.orig_dtype) for p in fully_sharded_parameters(module)}),
        "fsdp_units": len(fully_sharded_units(module)),
        "checkpointed_blocks": sum(isinstance(m, CheckpointWrapper) for m in module.modules()),
    }
