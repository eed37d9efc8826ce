"""DDP: Lightning's own strategy, which already runs on CPU (gloo) and CUDA (nccl) alike."""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy


class DDPStrategy(_LightningDDPStrategy):
    """Data-parallel training; registered as `ld_ddp` so it sits beside our FSDP and DeepSpeed presets.

    Lightning's DDP needs no change to run on CPU. The subclass exists so every preset of this package is one of
    our classes (and one place to put a fix, should Lightning's ever need one).
    """

    strategy_name = "ld_ddp"
