"""Lightning strategies that run the same on CPU (gloo) and CUDA (nccl). No Hydra in here."""

from lightning_dist.strategies.ddp import DDPStrategy
from lightning_dist.strategies.deepspeed import DeepSpeedStrategy
from lightning_dist.strategies.fsdp import FSDPStrategy
from lightning_dist.strategies.presets import PRESETS, REGISTRY_PREFIX, register_presets

register_presets()  # again, harmlessly, when `import lightning_dist` already did

__all__ = ["DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "PRESETS", "REGISTRY_PREFIX", "register_presets"]
