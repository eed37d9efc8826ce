"""The optimizer a run's ZeRO offload steps on the host: DeepSpeed's vectorised CPU Adam where the module configured
torch's Adam or AdamW (same parameter groups and hyper-parameters), else the module's own optimizer, which DeepSpeed
would refuse although it works there."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def optimizer_for_offload(
    optimizer: torch.optim.Optimizer, scheduler_config: Any, config: dict[str, Any]
) -> torch.optim.Optimizer:
    """The optimizer to hand DeepSpeed when `config` offloads optimizer state; a scheduler built around the torch
    optimizer is pointed at its replacement (it only reads and writes param_groups). May set
    `zero_force_ds_cpu_optimizer` in `config`."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        optimizer = as_deepspeed_cpu_adam(optimizer)
        if scheduler_config is not None:
            scheduler_config.scheduler.optimizer = optimizer
        return optimizer
    config["zero_force_ds_cpu_optimizer"] = False
    rank_zero_info(f"Optimizer offload: {type(optimizer).__name__} steps on the CPU (no DeepSpeed kernel for it)")
    return optimizer


def as_deepspeed_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's offload runs the optimizer step on the host, where its vectorised CPU Adam is much faster than
    torch's: same parameter groups and hyper-parameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = optimizer.defaults
    cpu_adam = DeepSpeedCPUAdam(
        optimizer.param_groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        amsgrad=defaults.get("amsgrad", False),
        adamw_mode=isinstance(optimizer, torch.optim.AdamW),
    )
    rank_zero_info(
        f"Optimizer offload: {type(optimizer).__name__} replaced by DeepSpeedCPUAdam (same hyper-parameters)"
    )
    return cpu_adam


def offload_device(offload_config: Any) -> str | None:
    """The device of one of the engine's offload sections (`zero_offload_optimizer()`, `zero_offload_param()`), or
    None when it offloads nothing."""
    if offload_config is None:
        return None
    device = getattr(offload_config.device, "value", offload_config.device)  # an enum, or its value
    return None if device == "none" else str(device)
