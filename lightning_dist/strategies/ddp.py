"""The name `lightning_dist.strategies.ddp.DDPStrategy` that configs written before the engine slices use."""

from lightning_dist.strategies.torch.ddp import DDPStrategy

__all__ = ["DDPStrategy"]
