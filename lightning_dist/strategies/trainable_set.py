"""Which parameters train, when it changes during a fit: Lightning's `BaseFinetuning` callbacks
(`BackboneFinetuning` unfreezes a backbone at an epoch), or a module's own hook setting `requires_grad`.

Each engine sets up at the start what it reduces and steps. Under Lightning's ddp a backbone unfrozen at epoch 1
went on training each rank's own copy, without a word (DDP reduces the parameters that required grad when it wrapped
the model: Lightning #20340, open); Lightning refuses the callback under DeepSpeed once every rank has started
(ZeRO flattens the trainable parameters into its optimizer's partitions at setup). Here each engine follows the
change at the next batch (`StrategyBase.follow_trainable_change`): FSDP2 reads `requires_grad` at every unshard
(nothing to do), ld_ddp wraps the model in a new DDP over the parameters that train now; DeepSpeed stops the launch
in one line where a `BaseFinetuning` is given, and the fit at the next batch, on every rank, where a hook changed it.
Measured (2 CPU ranks, a transformers Llama, SGD; tests/strategies/test_trainable_set.py): the backbone unfrozen at
epoch 1 trains the losses of a backbone trainable throughout at a learning rate of 0 until then.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# What to do instead where an engine cannot follow: Lightning #20340's answer.
INSTEAD = ("freeze before the fit and keep it so, or train those weights from the start at a learning rate of 0 in a"
           " param group of their own and raise it when they are to train (Lightning #20340)")


def refuse_finetuning_callbacks(trainer: Any, strategy_name: str, why: str | None) -> None:
    """A ValueError where `trainer` has Lightning's `BaseFinetuning` (`BackboneFinetuning`, a subclass of the
    user's), which unfreezes parameters during the fit, and `why` (the engine's reason) is not None."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in getattr(trainer, "callbacks", []):
        if why is not None and isinstance(callback, BaseFinetuning):
            raise ValueError(f"{type(callback).__name__} (Lightning's BaseFinetuning) unfreezes parameters during the"
                             f" fit, and {strategy_name} {why}: {INSTEAD}")


class TrainableSet:
    """Which of a module's parameters require grad, as recorded when the fit starts (or last followed)."""

    def __init__(self, module: nn.Module) -> None:
        self.flags = [parameter.requires_grad for parameter in module.parameters()]

    def changed(self, module: nn.Module) -> bool:
        """A loop over the parameters' flags on the host: no device read."""
        return [parameter.requires_grad for parameter in module.parameters()] != self.flags

    def refusal(self, module: nn.Module, strategy_name: str, why: str) -> str:
        """The one line that says what changed and why `strategy_name` cannot follow."""
        named = list(module.named_parameters())
        unfrozen = [name for (name, p), was in zip(named, self.flags) if p.requires_grad and not was]
        frozen = [name for (name, p), was in zip(named, self.flags) if was and not p.requires_grad]
        changed = (f"{len(unfrozen)} became trainable (the first: {unfrozen[0]})" if unfrozen
                   else f"{len(frozen)} were frozen (the first: {frozen[0]})" if frozen
                   else "the module's parameters are not those it started with")
        return f"the trainable parameters changed during the fit: {changed}; {strategy_name} {why}: {INSTEAD}"
