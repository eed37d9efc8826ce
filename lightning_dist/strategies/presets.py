"""The named presets: a class plus keyword arguments, as in Lightning's own registry.

Each preset is registered with Lightning as `ld_<name>` (so `L.Trainer(strategy="ld_fsdp")` works after
`import lightning_dist`) and mirrored by `conf/strategy/<name>.yaml` for Hydra; a test keeps the two equal. The
prefix keeps Lightning's own `ddp`, `fsdp` and `deepspeed_*`, which refuse CPU, reachable and unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from lightning.pytorch.strategies import StrategyRegistry, Strategy

from lightning_dist.strategies.ddp import DDPStrategy
from lightning_dist.strategies.deepspeed import DeepSpeedStrategy
from lightning_dist.strategies.fsdp import FSDPStrategy

REGISTRY_PREFIX = "ld_"


class Preset(NamedTuple):
    strategy: type[Strategy]
    kwargs: dict[str, Any]
    description: str


PRESETS: dict[str, Preset] = {
    "ddp": Preset(DDPStrategy, {}, "Distributed data parallel: a full replica per rank"),
    "fsdp": Preset(FSDPStrategy, {"sharding_strategy": "FULL_SHARD"}, "FSDP2, parameters, gradients and optimizer state sharded"),
    "fsdp_shard_grad_op": Preset(FSDPStrategy, {"sharding_strategy": "SHARD_GRAD_OP"}, "FSDP2 keeping gathered parameters from forward to backward"),
    "fsdp_activation_checkpointing": Preset(FSDPStrategy, {"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True}, "FSDP2 with per-block activation checkpointing"),
    "fsdp_cpu_offload": Preset(FSDPStrategy, {"sharding_strategy": "FULL_SHARD", "cpu_offload": True}, "FSDP2 with shards kept in host memory"),
    "deepspeed_stage_1": Preset(DeepSpeedStrategy, {"stage": 1}, "DeepSpeed ZeRO-1: optimizer state sharded"),
    "deepspeed_stage_2": Preset(DeepSpeedStrategy, {"stage": 2}, "DeepSpeed ZeRO-2: optimizer state and gradients sharded"),
    "deepspeed_stage_2_offload": Preset(DeepSpeedStrategy, {"stage": 2, "offload_optimizer": "cpu"}, "ZeRO-2 with optimizer state and step on the CPU"),
    "deepspeed_stage_3": Preset(DeepSpeedStrategy, {"stage": 3}, "DeepSpeed ZeRO-3: parameters sharded too"),
    "deepspeed_stage_3_offload": Preset(DeepSpeedStrategy, {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"}, "ZeRO-3 with optimizer state and parameters on the CPU"),
    "deepspeed_stage_3_offload_nvme": Preset(DeepSpeedStrategy, {"stage": 3, "offload_optimizer": "nvme", "offload_parameters": "nvme", "nvme_path": "/local_nvme"}, "ZeRO-Infinity: ZeRO-3 with optimizer state and parameters on an NVMe drive"),
}


def register_presets(registry=StrategyRegistry) -> None:
    """Register every preset as `ld_<name>`; safe to call more than once."""
    for name, preset in PRESETS.items():
        registry.register(
            REGISTRY_PREFIX + name, preset.strategy, description=preset.description, override=True, **preset.kwargs
        )
