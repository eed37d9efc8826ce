"""Pick the least-sharded strategy whose plan fits the devices, and say why each cheaper one did not.

Less sharding means less communication, so the ladder is climbed from the bottom: DDP, then sharded gradients
(ZeRO-2 / FSDP SHARD_GRAD_OP), then everything sharded (ZeRO-3 / FSDP FULL_SHARD), then (FSDP) each layer split
over 2 ranks as well, for a model whose gathered layers do not fit, then (FSDP) each sequence split over 2 ranks
(context parallelism: the activations halve, the weights stay sharded over every rank) where the context is what
does not fit, then its blocks in 2 pipeline stages, which divides the activations a rank holds (a stage keeps its
blocks' activations only) at the cost of holding its stage gathered through backward, then CPU offload, then NVMe.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy

from lightning_dist._compat.registry import registered_arguments, registered_strategy
from lightning_dist.memory.layout import layout_of
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.memory.planner import GB, MemoryPlan, plan_memory
from lightning_dist.parallel import context_parallel, expert_parallel, pipeline_layout, tensor_parallel

# Each parallel axis's precondition on the model (its room's `model_unsplit`: why the model, as its facts describe
# it, cannot be split over that many ranks of the axis, or None), checked for a rung whose layout has the axis.
MODEL_SPLITS = (("tensor", tensor_parallel.model_unsplit), ("context", context_parallel.model_unsplit),
                ("pipeline", pipeline_layout.model_unsplit), ("expert", expert_parallel.model_unsplit))

log = logging.getLogger(__name__)

LADDERS = {
    "deepspeed": (
        "ddp",
        "deepspeed_stage_2",
        "deepspeed_stage_3",
        "deepspeed_stage_3_offload",
        "deepspeed_stage_3_offload_nvme",
    ),
    "fsdp": ("ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ep", "fsdp_tp", "fsdp_cp", "fsdp_pp", "fsdp_cpu_offload",
             "deepspeed_stage_3_offload_nvme"),
}
# Rungs that are a preset with options rather than a preset of their own: (preset, its options). fsdp_ep: a mixture
# of experts whose layer, gathered whole, is what does not fit (each rank gathers half of its experts).
RUNGS: dict[str, tuple[str, dict[str, Any]]] = {"fsdp_cp": ("fsdp", {"context_parallel_size": 2}),
                                                "fsdp_ep": ("fsdp", {"expert_parallel_size": 2})}


class NothingFits(ValueError):
    """Not even the last rung fits; the message lists every rung's shortfall."""


@dataclass
class Choice:
    name: str
    strategy: Strategy
    plan: MemoryPlan
    rejected: list[tuple[str, str]]  # (preset, why it does not fit)


@dataclass
class AutoFit:
    """`strategy=auto_fit`: a placeholder the run replaces with the chosen preset once the model is known.

    device_memory_gb: memory of one device; None reads it (CUDA device 0, or host memory / devices on CPU).
    host_memory_gb: host memory of one node, for offload; None reads this machine's.
    headroom: the fraction of memory a plan may use (fragmentation, allocator caches, the framework itself).
    compile: the chosen strategy compiles each block (regional torch.compile).
    """

    device_memory_gb: float | None = None
    host_memory_gb: float | None = None
    headroom: float = 0.85
    family: str = "deepspeed"
    nvme_path: str | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if self.family not in LADDERS:
            raise ValueError(f"strategy.family: {self.family!r} is not a ladder; choose one of {', '.join(LADDERS)}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"strategy.headroom: {self.headroom} must be in (0, 1]")

    def choose(
        self, facts: ModelFacts, precision: str, devices: int, num_nodes: int = 1, accelerator: str = "cpu"
    ) -> Choice:
        device_budget = self.headroom * (
            self.device_memory_gb * GB if self.device_memory_gb else _device_memory(accelerator, devices)
        )
        host_budget = self.headroom * (self.host_memory_gb * GB if self.host_memory_gb else _host_memory())
        rejected: list[tuple[str, str]] = []
        for name in LADDERS[self.family]:
            preset, options = RUNGS.get(name, (name, {}))
            overrides: dict[str, Any] = {"compile": self.compile, **options}
            if "nvme_path" in registered_arguments(preset):
                if not self.nvme_path:
                    rejected.append((name, "no strategy.nvme_path to offload to"))
                    continue
                overrides["nvme_path"] = self.nvme_path
            strategy = registered_strategy(preset, **overrides)  # the preset, as `ld_<name>` names it
            layout = layout_of(strategy, name)
            unsplit = next((why for axis, unfit in MODEL_SPLITS if (size := getattr(layout.sizes, axis)) > 1
                            and (why := unfit(facts, size))), None)
            if unsplit:
                rejected.append((name, unsplit))
                continue
            try:
                plan = plan_memory(facts, layout, precision, devices=devices, num_nodes=num_nodes)
            except ValueError as error:  # a layout the ranks do not divide into
                rejected.append((name, str(error)))
                continue
            why = _shortfall(plan, device_budget, host_budget)
            if why is None:
                for cheaper, reason in rejected:
                    log.info(f"auto_fit: not {cheaper}: {reason}")
                log.info(
                    f"auto_fit: chose {name}: {plan.device_total / GB:.2f} GB per device of {device_budget / GB:.2f} "
                    "GB usable"
                )
                return Choice(name, strategy, plan, rejected)
            rejected.append((name, why))
        raise NothingFits("strategy=auto_fit: nothing fits: " + " | ".join(f"{n}: {why}" for n, why in rejected))


def _shortfall(plan: MemoryPlan, device_budget: float, host_budget: float) -> str | None:
    if plan.device_total > device_budget:
        return f"needs {plan.device_total / GB:.2f} GB per device, {device_budget / GB:.2f} GB usable"
    if plan.host_peak > host_budget:
        return f"needs {plan.host_peak / GB:.2f} GB of host memory per node, {host_budget / GB:.2f} GB usable"
    return None


def _device_memory(accelerator: str, devices: int) -> float:
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return float(torch.cuda.get_device_properties(0).total_memory)
    return _host_memory() / devices  # CPU ranks share the host


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
