"""The optimizer DeepSpeed is handed holds trainable parameters only, and its schedule still sees every group.

DeepSpeed's ZeRO optimizers take their working dtype from the first parameter of the first group, build one flat
partition per group out of its trainable parameters, and drop the groups that hold no parameters from the
optimizer's own list. A LoRA module's optimizer, configured as users write it, broke each rule:
- `AdamW(self.parameters())` puts the frozen base first: kept in bf16 as loaded (precision.py), it set ZeRO's dtype,
  and ZeRO-2 held the fp32 adapters' gradients in bf16, ZeRO-3's parameter offload the adapters themselves (measured);
- a group of frozen weights only (the no-decay group of a LoRA model's norms and biases) stopped ZeRO-1 and ZeRO-2 at
  set-up with `IndexError: list index out of range` (DeepSpeed #4055);
- a group left empty (the same no-decay group built from trainable parameters, as nanoGPT builds it) was dropped from
  the list the module's scheduler steps: `ValueError: zip() argument 2 is longer than argument 1` at the first step of
  a LambdaLR (torch 2.13), each later group's schedule moved onto the group before it under others.
So the frozen weights leave every group (a torch optimizer keeps no state for them either), and where a group is left
empty the scheduler is given a view of the optimizer with every group the module configured, the same group dicts
DeepSpeed steps: the rate it sets is the rate they step with.
"""

from __future__ import annotations

from typing import Any

import torch


def leave_frozen_weights_out(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter group of `optimizer` without its frozen parameters, in place; one line where none trains."""
    for group in optimizer.param_groups:
        group["params"] = [parameter for parameter in group["params"] if parameter.requires_grad]
    if not any(group["params"] for group in optimizer.param_groups):
        raise ValueError(
            f"configure_optimizers: every parameter of the {type(optimizer).__name__} it returns is frozen"
            " (requires_grad=False): DeepSpeed has nothing to train; unfreeze the weights to train"
        )


def schedule_every_group(optimizer: torch.optim.Optimizer, scheduler_config: Any) -> None:
    """Where `optimizer` has a group DeepSpeed will drop (no parameters), its scheduler is pointed at a view that
    keeps every group."""
    if scheduler_config is None or all(group["params"] for group in optimizer.param_groups):
        return
    scheduler = scheduler_config.scheduler
    if getattr(scheduler, "optimizer", None) is not optimizer:  # a scheduler of its own kind, not torch's
        raise ValueError(
            f"configure_optimizers: {type(scheduler).__name__} schedules an optimizer with a parameter group that"
            " trains nothing, which DeepSpeed drops; leave that group out"
        )
    scheduler.optimizer = EveryGroup(optimizer)


class EveryGroup:
    """`optimizer` as its scheduler reads it: the groups it was configured with, where DeepSpeed trims the list it
    steps. Anything else is the optimizer's own; it compares equal to it (Lightning's LearningRateMonitor matches
    schedulers to optimizers so) and reports its class."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.wrapped = optimizer
        self.param_groups = list(optimizer.param_groups)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.wrapped)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.wrapped

    def __hash__(self) -> int:
        return hash(self.wrapped)
