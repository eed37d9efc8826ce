"""Activation checkpointing per block: keep a block's inputs, recompute its activations in backward. Besides every
block (full), two selective forms, as torchtitan offers them: every k-th block only, and op-level, where a
checkpointed block also keeps the outputs of its matrix products and attention (the costly ops to recompute) and
recomputes only the cheap element-wise and normalisation ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_dist._compat.torch import ATTENTION_KERNEL_OPS, CheckpointWrapper, checkpoint_wrapper, wrapped_module

CHOICES = (
    "false, true (every block), ops (every block, keeping matrix products and attention), or an integer k >= 1 "
    "(every k-th block)"
)


def _aten_ops(*names: str) -> frozenset:
    """The aten overloads of `names` this torch build has (the attention kernels differ by device and version)."""
    found: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


# What op-level checkpointing keeps: the outputs of matrix products and attention, torchtitan's choice (its
# `_save_list`); each costs O(d) per element to recompute, while what is recomputed costs O(1).
KEPT_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", *ATTENTION_KERNEL_OPS)


@dataclass(frozen=True)
class CheckpointPlan:
    """Which blocks are checkpointed, and whether a checkpointed block keeps its matrix products' outputs."""

    every: int = 1      # every k-th block (1: all of them)
    ops: bool = False   # op-level: keep KEPT_OPS' outputs, recompute the rest

    @classmethod
    def of(cls, value: Any, key: str = "strategy.activation_checkpointing") -> CheckpointPlan | None:
        """None for false/none; a plan for true/full, ops, or an integer k; a ValueError naming `key` otherwise."""
        if value is None or value is False or value == "none":
            return None
        if value is True or value == "full":
            return cls()
        if value == "ops":
            return cls(ops=True)
        if isinstance(value, int) and value >= 1:
            return cls(every=value)
        if isinstance(value, CheckpointPlan):
            return value
        raise ValueError(f"{key}={value!r}: must be {CHOICES}")

    def checkpoints(self, index: int) -> bool:
        """Whether block `index` (0-based, in model order) is checkpointed: the k-th, 2k-th, ... block."""
        return (index + 1) % self.every == 0

    def __str__(self) -> str:
        return "ops" if self.ops else "full" if self.every == 1 else f"every {self.every} blocks"


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_products)


def apply_activation_checkpointing(
    model: nn.Module, block_classes: tuple[type[nn.Module], ...], plan: CheckpointPlan = CheckpointPlan()
) -> int:
    """Wrap the blocks of `model` that `plan` checkpoints (of `block_classes`, counted in model order) in a
    non-reentrant checkpoint wrapper, in place.

    Idempotent: Lightning calls strategy set-up again for `trainer.test()` after `fit()` on the same model, and a
    block wrapped twice would be recomputed twice. Returns how many blocks are wrapped afterwards.

    A `transformers` model with `config.use_cache` appends each layer's keys and values to a cache as it runs, so
    the recomputation would find the cache the first pass filled (BART's decoder then fails with "a different number
    of tensors was saved"). Training needs no cache: it is turned off, as transformers' own
    `gradient_checkpointing_enable` does.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            config.use_cache = False
    options: dict[str, Any] = {"context_fn": _selective_contexts} if plan.ops else {}
    index = 0
    for parent in list(model.modules()):
        if isinstance(parent, CheckpointWrapper):
            continue
        for name, child in parent.named_children():
            wrapped = wrapped_module(child) if isinstance(child, CheckpointWrapper) else None
            if isinstance(wrapped or child, block_classes):
                if wrapped is None and plan.checkpoints(index):
                    parent.register_module(name, checkpoint_wrapper(child, **options))
                index += 1
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())
