"""Strategy mixin: under context parallelism each step runs on this rank's shard of every sequence, its attention
exchanged across the group in forward and in backward (where checkpointed blocks run it again), and what it logs
averaged over the group (parallel/context_parallel.py). Without a group (`context` unset) it adds nothing."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist.parallel.block_options import BlockOptions
from lightning_dist.parallel.context_parallel import ContextParallel, RingContextParallel


class SplitsSequences(StrategyMixin):
    context: ContextParallel | None = None  # set by the strategy's `setup` when it has a context-parallel axis
    blocks: BlockOptions  # the strategy's (strategies/base.py)

    def expect_exchanges(self, model: nn.Module) -> None:
        """What each step's attention exchanges are checked against: one per block of `model` (each decoder block
        attends once), and whether checkpointed blocks recompute them in backward."""
        if self.context is None or isinstance(self.context, RingContextParallel):  # torch's own, on CUDA
            return
        classes = self.blocks.classes_in(model)
        self.context.attention_layers = sum(isinstance(module, classes) for module in model.modules()) if classes else 0
        self.context.recomputes = self.blocks.checkpointing is not None
        self.context.model_name = type(model).__name__

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            return super().training_step(*args, **kwargs)
        shard = self.context.shard(args[0])  # first: the shard's length is what ring attention is set up for
        with self.context.step(self.lightning_module):
            return super().training_step(shard, *args[1:], **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            return super().validation_step(*args, **kwargs)
        shard = self.context.shard(args[0])  # first: the shard's length is what ring attention is set up for
        with self.context.step(self.lightning_module):
            return super().validation_step(shard, *args[1:], **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            return super().test_step(*args, **kwargs)
        shard = self.context.shard(args[0])  # first: the shard's length is what ring attention is set up for
        with self.context.step(self.lightning_module):
            return super().test_step(shard, *args[1:], **kwargs)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with self.context.attention():  # checkpointed blocks run their attention again in backward
            return super().backward(closure_loss, optimizer, *args, **kwargs)
