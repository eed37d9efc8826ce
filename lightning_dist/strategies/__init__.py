"""Lightning strategies that run the same on CPU (gloo) and CUDA (nccl). No Hydra in here.

The classes load on first use (`from lightning_dist.strategies import FSDPStrategy`): the preset table next to them
is read to register the names with Lightning while Lightning, or one of our own modules, is still being imported.
"""

from typing import Any

from lightning_dist.strategies.presets import PRESETS, REGISTRY_PREFIX, register_presets

_CLASSES = {
    "DDPStrategy": "lightning_dist.strategies.torch.ddp",
    "DeepSpeedStrategy": "lightning_dist.strategies.deepspeed.strategy",
    "FSDPStrategy": "lightning_dist.strategies.torch.fsdp",
}

__all__ = [*_CLASSES, "PRESETS", "REGISTRY_PREFIX", "register_presets"]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        import importlib

        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'lightning_dist.strategies' has no attribute {name!r}")
