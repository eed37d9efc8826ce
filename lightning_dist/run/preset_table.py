"""`plan=true`'s second table, one line per named preset: the answer to "which strategy do I need for this model on
these devices?"."""

from __future__ import annotations

from lightning_dist.memory.layout import layout_of
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.memory.planner import GB, plan_memory
from lightning_dist.strategies.presets import PRESETS


def compare_presets(facts: ModelFacts, precision: str, devices: int, num_nodes: int = 1) -> str:
    lines = [
        f"All presets for {facts.parameters:,} parameters, {precision}, {devices * num_nodes} ranks (GB per device / "
        "per node):",
        "| preset | model state | device total | host | NVMe |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, preset in PRESETS.items():
        layout = layout_of(preset.strategy(**preset.kwargs), name)
        try:
            layout.parallel_dims(devices, num_nodes)
        except ValueError:  # a layout these ranks cannot take (tensor parallelism over 2 ranks on 1)
            lines.append(f"| {name} | - | - | - | - |")
            continue
        plan = plan_memory(facts, layout, precision, devices=devices, num_nodes=num_nodes)
        nvme = sum(plan.nvme.values())
        lines.append(f"| {name} | {plan.model_state_per_device / GB:.3f} | {plan.device_total / GB:.3f} | "
                     f"{plan.host_total / GB:.3f} | {nvme / GB:.3f} |")
    return "\n".join(lines)
