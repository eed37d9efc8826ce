"""DeepSpeed's precision, with the frozen weights kept as loaded at 32-true, as ddp and fsdp keep them.

At 32-true (the Trainer's default) Lightning's DeepSpeed precision casts the whole module to fp32, though DeepSpeed's
engine casts nothing at fp32. A LoRA base that transformers loaded in bf16 (the dtype it was saved in) then took twice
its memory under DeepSpeed alone, and was computed in fp32 there and in bf16 under ddp and fsdp: measured with a
Llama, its 39 frozen weights fp32 under ZeRO-2 and ZeRO-3 and bf16 under ddp and fsdp, the losses up to 1.7e-4
apart. Here only the trainable weights are cast to fp32 (parallel/precision.py), once the config has settled the
precision; the other precisions convert as Lightning's do (the engine casts everything to its 16-bit dtype).
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from torch import nn
from typing_extensions import override

from lightning_dist.parallel.precision import say_upcast, upcast_trainable_weights


class FrozenWeightsAsLoaded(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision, converting a module at 32-true by its trainable weights only."""

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision != "32-true":
            return super().convert_module(module)
        say_upcast(self.precision, upcast_trainable_weights(module, self.precision))
        return module
