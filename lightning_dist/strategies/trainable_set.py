"""Which parameters train stays as it was when the fit's engine set up.

Each engine fixes at setup what it reduces and steps: DDP's reducer buckets the parameters that required grad when it
wrapped the model, ZeRO flattens them into its optimizer's partitions, FSDP2 groups each unit's gradients for its
reduce-scatter. A parameter unfrozen later then trains wrong without a word. Measured (2 CPU ranks, a transformers
Llama whose backbone Lightning's `BackboneFinetuning` unfroze at epoch 1): under Lightning's ddp and ld_ddp each rank
went on training its own copy of the backbone (DDP never reduced its gradients: Lightning #20340, open), under ld_fsdp
the backbone's gradients were 0.65 to 0.72 of ddp's; Lightning refuses the callback under DeepSpeed, once every rank
has started. Now `BaseFinetuning` stops the launch in one line, and a set changed any other way (a module's own hook)
stops the fit at the next batch, on every rank, in one line.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# What to do instead, as Lightning #20340's answer does it: every parameter the fit will train is trainable from its
# start, those not yet trained at a learning rate of 0 (a param group of their own, raised by a scheduler or a hook).
INSTEAD = ("freeze before the fit and keep it so, or train those weights from the start at a learning rate of 0 in a"
           " param group of their own and raise it when they are to train (Lightning #20340)")


def refuse_finetuning_callbacks(trainer: Any, strategy_name: str) -> None:
    """A ValueError where `trainer` has Lightning's `BaseFinetuning` (`BackboneFinetuning`, a subclass of the user's):
    it freezes parameters at setup and unfreezes them during the fit."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, BaseFinetuning):
            raise ValueError(f"{type(callback).__name__} (Lightning's BaseFinetuning) unfreezes parameters during the"
                             f" fit, and {strategy_name} reduces and steps those that were trainable at its setup:"
                             f" {INSTEAD}")


class TrainableSet:
    """Which of a module's parameters require grad, as recorded when the fit starts."""

    def __init__(self, module: nn.Module) -> None:
        self.flags = [parameter.requires_grad for parameter in module.parameters()]

    def check(self, module: nn.Module, strategy_name: str) -> None:
        """A RuntimeError in one line where it changed since: a loop over the parameters' flags, no device read."""
        if [parameter.requires_grad for parameter in module.parameters()] == self.flags:
            return
        named = list(module.named_parameters())
        unfrozen = [name for (name, p), was in zip(named, self.flags) if p.requires_grad and not was]
        frozen = [name for (name, p), was in zip(named, self.flags) if was and not p.requires_grad]
        changed = (f"{len(unfrozen)} became trainable (the first: {unfrozen[0]})" if unfrozen
                   else f"{len(frozen)} were frozen (the first: {frozen[0]})" if frozen
                   else "the module's parameters are not those it started with")
        raise RuntimeError(f"the trainable parameters changed during the fit: {changed}; {strategy_name} reduces and"
                           f" steps those that were trainable at its setup: {INSTEAD}")
