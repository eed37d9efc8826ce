"""The named presets: a class plus keyword arguments, as in Lightning's own registry.

Each preset is registered with Lightning as `ld_<name>` (so `L.Trainer(strategy="ld_fsdp")` works after
`import lightning_dist`) and mirrored by `conf/strategy/<name>.yaml` for Hydra; a test keeps the two equal. The
prefix (REGISTRY_PREFIX) keeps Lightning's own `ddp`, `fsdp` and `deepspeed_*`, which refuse CPU, reachable.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

from lightning_dist._compat.registry import REGISTRY_PREFIX

DDP, FSDP, DEEPSPEED = (
    "lightning_dist.strategies.torch.ddp.DDPStrategy",
    "lightning_dist.strategies.torch.fsdp.FSDPStrategy",
    "lightning_dist.strategies.deepspeed.strategy.DeepSpeedStrategy",
)


class Preset(NamedTuple):
    """A strategy class, by dotted path (this table is read to register the names before Lightning, or our strategy
    modules, may be imported), and its keyword arguments."""

    class_path: str
    kwargs: dict[str, Any]
    description: str

    @property
    def strategy(self) -> type:
        module, name = self.class_path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    def __call__(self, **kwargs: Any) -> Any:
        """What Lightning's registry calls, with `kwargs` (the registered ones, which it passes back)."""
        return self.strategy(**kwargs)


PRESETS: dict[str, Preset] = {
    "ddp": Preset(DDP, {}, "Distributed data parallel: a full replica per rank"),
    "fsdp": Preset(
        FSDP, {"sharding_strategy": "FULL_SHARD"}, "FSDP2, parameters, gradients and optimizer state sharded"
    ),
    "fsdp_shard_grad_op": Preset(
        FSDP, {"sharding_strategy": "SHARD_GRAD_OP"}, "FSDP2 keeping gathered parameters from forward to backward"
    ),
    "fsdp_activation_checkpointing": Preset(
        FSDP,
        {"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True},
        "FSDP2 with per-block activation checkpointing",
    ),
    "fsdp_tp": Preset(
        FSDP,
        {"sharding_strategy": "FULL_SHARD", "tensor_parallel_size": 2},
        "FSDP2 over the data-parallel ranks, each layer split over 2 ranks of a node (tensor parallel): a 2-D mesh",
    ),
    "hsdp_tp": Preset(
        FSDP,
        {"sharding_strategy": "HYBRID_SHARD", "tensor_parallel_size": 2},
        "HSDP (replicated across nodes, sharded within) with each layer split over 2 ranks: a 3-D mesh",
    ),
    "fsdp_pp": Preset(
        FSDP,
        {"sharding_strategy": "FULL_SHARD", "pipeline_parallel_size": 2},
        "Pipeline parallelism over 2 stages outermost, FSDP2 inside each stage: a 2-D mesh",
    ),
    "fsdp_tp_pp": Preset(
        FSDP,
        {"sharding_strategy": "FULL_SHARD", "pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "2 pipeline stages, FSDP2 over the data-parallel ranks, each layer split over 2 ranks: a 3-D mesh",
    ),
    "fsdp_cpu_offload": Preset(
        FSDP, {"sharding_strategy": "FULL_SHARD", "cpu_offload": True}, "FSDP2 with shards kept in host memory"
    ),
    "deepspeed_stage_1": Preset(DEEPSPEED, {"stage": 1}, "DeepSpeed ZeRO-1: optimizer state sharded"),
    "deepspeed_stage_2": Preset(DEEPSPEED, {"stage": 2}, "DeepSpeed ZeRO-2: optimizer state and gradients sharded"),
    "deepspeed_stage_2_offload": Preset(
        DEEPSPEED, {"stage": 2, "offload_optimizer": "cpu"}, "ZeRO-2 with optimizer state and step on the CPU"
    ),
    "deepspeed_stage_3": Preset(DEEPSPEED, {"stage": 3}, "DeepSpeed ZeRO-3: parameters sharded too"),
    "deepspeed_stage_3_offload": Preset(
        DEEPSPEED,
        {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"},
        "ZeRO-3 with optimizer state and parameters on the CPU",
    ),
    "deepspeed_stage_3_offload_nvme": Preset(
        DEEPSPEED,
        {"stage": 3, "offload_optimizer": "nvme", "offload_parameters": "nvme", "nvme_path": "/local_nvme"},
        "ZeRO-Infinity: ZeRO-3 with optimizer state and parameters on an NVMe drive",
    ),
}


def register_presets(registry: Any = None) -> None:
    """Register every preset as `ld_<name>` (Lightning's registry unless another is given); safe to call more than
    once. Imports no strategy module: the class is imported when Lightning builds the strategy."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for name, preset in PRESETS.items():
        registry.register(
            REGISTRY_PREFIX + name, preset, description=preset.description, override=True, **preset.kwargs
        )
