"""Activation checkpointing per block: keep a block's inputs, recompute its activations in backward."""

from __future__ import annotations

from torch import nn

from lightning_dist._compat.torch import CheckpointWrapper, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, block_classes: tuple[type[nn.Module], ...]) -> int:
    """Wrap every submodule of `model` of one of `block_classes` in a non-reentrant checkpoint wrapper, in place.

    Idempotent: Lightning calls strategy set-up again for `trainer.test()` after `fit()` on the same model, and a
    block wrapped twice would be recomputed twice. Returns how many blocks are wrapped afterwards.

    A `transformers` model with `config.use_cache` appends each layer's keys and values to a cache as it runs, so
    the recomputation would find the cache the first pass filled (BART's decoder then fails with "a different number
    of tensors was saved"). Training needs no cache: it is turned off, as transformers' own
    `gradient_checkpointing_enable` does.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
    for parent in list(model.modules()):
        if isinstance(parent, CheckpointWrapper):
            continue
        for name, child in parent.named_children():
            if isinstance(child, block_classes):
                parent.register_module(name, checkpoint_wrapper(child))
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())
