"""Parallelism mechanics as plain functions: usable and testable without a Trainer."""

from lightning_dist.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_dist.parallel.classes import (
    BlockClasses, block_classes_for, infer_block_classes, require_classes_in_model, resolve_block_classes,
    resolve_module_class,
)
from lightning_dist.parallel.fsdp import (
    apply_fully_shard, materialize_shards, mixed_precision_policy, offload_policy, shard_device, sharding_layout,
)

__all__ = [
    "apply_activation_checkpointing",
    "apply_fully_shard",
    "BlockClasses",
    "block_classes_for",
    "infer_block_classes",
    "materialize_shards",
    "mixed_precision_policy",
    "offload_policy",
    "require_classes_in_model",
    "resolve_block_classes",
    "resolve_module_class",
    "shard_device",
    "sharding_layout",
]
