"""Parallelism mechanics as plain functions: usable and testable without a Trainer.

The names load on first use, so that `lightning_dist.parallel.dims` (no torch) can be imported by the command line
without loading torch through this package.
"""

from typing import Any

_NAMES = {
    "apply_activation_checkpointing": "lightning_dist.parallel.activation_checkpoint",
    "BlockClasses": "lightning_dist.parallel.classes",
    "block_classes_for": "lightning_dist.parallel.classes",
    "infer_block_classes": "lightning_dist.parallel.classes",
    "require_classes_in_model": "lightning_dist.parallel.classes",
    "resolve_block_classes": "lightning_dist.parallel.classes",
    "resolve_module_class": "lightning_dist.parallel.classes",
    "sharding_layout": "lightning_dist.parallel.dims",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_dist.parallel' has no attribute {name!r}")
