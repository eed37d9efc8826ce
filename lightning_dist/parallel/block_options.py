"""What a strategy does to the model block by block before it wraps the model (DDP), shards it (FSDP) or hands it to
`deepspeed.initialize`: activation checkpointing, then compilation, in torchtitan's order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_dist.parallel.activation_checkpoint import CheckpointPlan, apply_activation_checkpointing
from lightning_dist.parallel.classes import BlockClasses, block_classes_for, resolve_block_classes
from lightning_dist.parallel.experts import every_expert_in_backward
from lightning_dist.parallel.regional_compile import compile_blocks


@dataclass(frozen=True)
class BlockOptions:
    """A strategy's block-by-block options: the block classes (configured, or () to infer them), activation
    checkpointing's plan (None: off) and regional compilation."""

    block_classes: BlockClasses = ()
    checkpointing: CheckpointPlan | None = None
    compile: bool = False

    @classmethod
    def of(cls, block_class: Any = None, activation_checkpointing: Any = False, compile: bool = False) -> BlockOptions:
        """From a strategy's arguments, each checked, naming its `strategy.` key."""
        classes = () if block_class is None else resolve_block_classes(block_class, "strategy.block_class")
        return cls(classes, CheckpointPlan.of(activation_checkpointing), bool(compile))

    @property
    def needed_by(self) -> list[str]:
        """The options on that need the model's blocks."""
        return ["activation checkpointing"] * (self.checkpointing is not None) + ["compile"] * self.compile

    def classes_in(self, model: nn.Module) -> BlockClasses:
        """The block classes of `model`; refused, naming `strategy.block_class`, when an option needs them and the
        model has none to infer."""
        return block_classes_for(model, self.block_classes, self.needed_by)

    def apply(self, model: nn.Module, classes: BlockClasses | None = None, hooks_outside: bool = False,
              device_type: str | None = None) -> None:
        """Checkpoint, then compile, the blocks of `model`, in place (each step idempotent); `hooks_outside` and
        `device_type` (where the model will run): see regional_compile.py. Layers with experts as modules give
        every expert a gradient on every rank (parallel/experts.py), whatever the options."""
        every_expert_in_backward(model)
        if not self.needed_by:
            return
        classes = classes if classes is not None else self.classes_in(model)
        if self.checkpointing is not None:
            apply_activation_checkpointing(model, classes, self.checkpointing)
        if self.compile:
            compile_blocks(model, classes, hooks_outside, device_type)
