"""`plan=true`'s second table, one line per named preset: the answer to "which strategy do I need for this model on
these devices?"."""

from __future__ import annotations

from torch import nn

from lightning_dist.memory.layout import layout_of
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.memory.planner import GB, plan_memory
from lightning_dist.strategies.presets import PRESETS


def compare_presets(facts: ModelFacts, precision: str, devices: int, num_nodes: int = 1,
                    model: nn.Module | None = None) -> str:
    """The table; with `model` (built on the meta device), a preset that cannot run it is marked, and why is said
    below the table in the words its launch would refuse it with."""
    refusals: dict[str, str] = {}
    lines = [
        f"All presets for {parameter_count(facts)}, {precision}, {devices * num_nodes} ranks"
        " (GB per device / per node):",
        "| preset | model state | device total | host | NVMe |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, preset in PRESETS.items():
        layout = layout_of(preset.strategy(**preset.kwargs), name)
        try:
            dims = layout.parallel_dims(devices, num_nodes)
        except ValueError:  # a layout these ranks cannot take (tensor parallelism over 2 ranks on 1)
            lines.append(f"| {name} | - | - | - | - |")
            continue
        if model is not None and (refusal := preset.strategy(**preset.kwargs).model_refusal(model, dims)):
            refusals[name] = refusal
            lines.append(f"| {name} | cannot run this model (below) | - | - | - |")
            continue
        plan = plan_memory(facts, layout, precision, devices=devices, num_nodes=num_nodes)
        nvme = sum(plan.nvme.values())
        lines.append(f"| {name} | {plan.model_state_per_device / GB:.3f} | {plan.device_total / GB:.3f} | "
                     f"{plan.host_peak / GB:.3f} | {nvme / GB:.3f} |")
    if facts.pretrained_largest:
        lines.append("(host: the larger of what the step offloads and what the ranks hold while they read the"
                     " pretrained weights, their rows of its largest tensor each (fsdp, ZeRO-3; elsewhere twice all"
                     " of it); each process's own memory not included)")
    lines += [f"{name} cannot run this model: {refusal}" for name, refusal in refusals.items()]
    return "\n".join(lines)


def parameter_count(facts: ModelFacts) -> str:
    """"1,000 parameters", or "8,192 trained of 1,008,192 parameters" where some are frozen (LoRA)."""
    total = facts.parameters + facts.frozen_parameters
    if facts.frozen_parameters:
        return f"{facts.parameters:,} trained of {total:,} parameters"
    return f"{total:,} parameters"
