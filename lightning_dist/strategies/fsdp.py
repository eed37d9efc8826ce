"""The name `lightning_dist.strategies.fsdp.FSDPStrategy` that configs written before the engine slices use."""

from lightning_dist.strategies.torch.fsdp import FSDPStrategy

__all__ = ["FSDPStrategy"]
