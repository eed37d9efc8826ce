"""lightning-dist: pick DDP, FSDP2 or DeepSpeed ZeRO by name; the same LightningModule trains on CPU or CUDA."""

from lightning_dist.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, register_presets

register_presets()

__all__ = ["DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy"]
