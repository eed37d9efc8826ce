"""A GPT whose blocks take a fixed time that does not hold the CPU, as a GPU's kernels leave the host free: each
block's forward sleeps `block_forward_s` and its backward twice that. Four ranks on two cores then keep the timings
a pipeline schedule assumes (every stage's work equal), so the idle share each rank measures can be compared with
the share the schedule implies."""

from __future__ import annotations

import time

import torch

from lightning_dist.models.gpt import GPTLanguageModel, TransformerBlock


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepingBlock(TransformerBlock):
    seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_Sleep.apply(x, self.seconds))


class TimedBlocksGPT(GPTLanguageModel):
    def __init__(self, block_forward_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        for block in self.model.blocks:
            block.__class__ = SleepingBlock
            block.seconds = block_forward_s
