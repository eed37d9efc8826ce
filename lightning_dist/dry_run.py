"""A dry run at the world size you will launch (`dry_run=true`): the strategy's own set-up and two training steps,
seen from one rank of `devices x num_nodes`, in this one process, with nothing allocated and nothing sent.

torch's fake process group completes every collective without sending anything, and fake tensors have shapes and
devices but no storage. The model is built on the meta device and sharded there by the strategy's `parallelize`
(its mesh, tensor parallelism, activation checkpointing, FSDP2), then given fake storage; FSDP2's memory tracker
follows the second step (the first counts DTensor temporaries at their global shape) and reports the rank's peak by
category. What a dry run cannot see: the CUDA context, library workspaces, allocator fragmentation, NCCL's buffers,
and time.

So far: the fsdp presets (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, activation checkpointing, tensor parallelism),
with CPU fakes. ddp and DeepSpeed: `plan=true`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

from lightning_dist._compat.torch import fake_process_group, fake_tensors, fsdp_memory_tracker, memory_categories
from lightning_dist.memory.attention_kernel import fused_attention
from lightning_dist.parallel.classes import block_modules
from lightning_dist.parallel.sharded_init import parameters_on_meta

# The tracker's categories, as the table names them, in the order a reader adds them up.
CATEGORIES = {
    "SHARDED_PARAM": "sharded parameters", "UNSHARDED_PARAM": "gathered parameters", "BUFFER": "buffers",
    "SHARDED_GRAD": "sharded gradients", "UNSHARDED_GRAD": "gathered gradients", "OPT": "optimizer state",
    "ALL_GATHER": "all-gather buffers", "REDUCE_SCATTER": "reduce-scatter buffers", "ACT": "activations",
    "TEMP": "temporaries", "INP": "inputs",
}


Shard = tuple[str, tuple[int, ...], tuple[int, ...], str]  # name, global shape, local shape, placements


@dataclass(frozen=True)
class RankView:
    """One rank of the dry run: where it sits in the mesh, what it holds of each parameter, its peak by category."""

    rank: int
    coordinate: dict[str, int]
    shards: list[Shard]
    peak: dict[str, int]  # bytes, by CATEGORIES' key, and "Total"


def dry_run_ranks(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int,
                  num_nodes: int, ranks: tuple[int, ...]) -> list[RankView]:
    """Each of `ranks` (global ranks of devices x num_nodes) set up by `strategy` and trained two steps on `batch`."""
    return [_one_rank(strategy, build, batch, precision, devices, num_nodes, rank) for rank in ranks]


def _one_rank(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int,
              num_nodes: int, rank: int) -> RankView:
    from lightning.pytorch.plugins.precision import Precision

    with fake_process_group(rank, devices * num_nodes):
        strategy.num_nodes = num_nodes
        strategy.parallel_devices = [torch.device("cpu")] * devices
        strategy.precision_plugin = Precision()
        strategy.precision_plugin.precision = precision
        mesh = strategy.build_device_mesh("cpu")
        with parameters_on_meta():
            model = build()
        strategy.parallelize(model)
        with ExitStack() as stack:
            stack.enter_context(fake_tensors())
            stack.enter_context(fused_attention())  # the attention kernel a device runs, not fake CPU's math path
            stack.enter_context(mock.patch.object(type(model), "log", lambda *a, **k: None, create=True))
            model.to_empty(device="cpu")
            optimizer = _optimizer(model)
            _step(model, optimizer, batch)  # creates the optimizer state; its DTensor temporaries have global size
            tracker = fsdp_memory_tracker(model, optimizer)
            tracker.track_inputs((batch,))
            with tracker:
                _step(model, optimizer, batch)
            peak = memory_categories(tracker)
        coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        return RankView(rank, coordinate, _shards(model, strategy.block_classes_of(model)), peak)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    configured = model.configure_optimizers() if hasattr(model, "configure_optimizers") else None
    configured = configured[0] if isinstance(configured, (list, tuple)) else configured
    configured = configured.get("optimizer") if isinstance(configured, dict) else configured
    return configured if isinstance(configured, torch.optim.Optimizer) else torch.optim.AdamW(model.parameters())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    step = getattr(model, "training_step", None)
    loss = step(batch, 0) if step is not None else model(batch)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _shards(model: nn.Module, block_classes: tuple[type[nn.Module], ...]) -> list[Shard]:
    """Every parameter outside the repeated blocks, and those of the first block: the other blocks repeat it."""
    blocks = block_modules(model, block_classes)
    others = tuple(f"{name}." for name, module in model.named_modules() if module in blocks[1:])
    rows = []
    for name, parameter in model.named_parameters():
        if name.startswith(others):
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        placements = ", ".join(str(p) for p in getattr(parameter, "placements", ())) or "whole"
        rows.append((name, tuple(parameter.shape), tuple(local.shape), placements))
    return rows


# The plan's categories beside the tracker's that count the same bytes.
PLANNED_AS = {"SHARDED_PARAM": "parameters", "SHARDED_GRAD": "gradients", "OPT": "optimizer_state",
              "UNSHARDED_PARAM": "gathered_parameters", "BUFFER": "buffers", "ACT": "activations"}


def table(views: list[RankView], name: str, precision: str, devices: int, num_nodes: int,
          planned: dict[str, float]) -> str:
    """The dry run's report: mesh coordinates, the first rank's shards, and each rank's peak beside the plan
    (`planned`: bytes per device by the plan's categories)."""
    world = devices * num_nodes
    unit, scale = ("GB", 1e9) if max(view.peak["Total"] for view in views) >= 1e9 else ("MB", 1e6)
    lines = [f"Dry run: {name}, {precision}, {world} ranks ({devices} per node) on fake devices: nothing allocated,"
             f" nothing sent; {unit} = 1e{len(str(int(scale))) - 1} bytes"]
    lines += [f"rank {v.rank}: " + ", ".join(f"{axis}={index}" for axis, index in v.coordinate.items()) for v in views]
    lines += ["", f"| parameter | global shape | rank {views[0].rank}'s shard | placement |", "|---|---|---|---|"]
    lines += [f"| {n} | {list(g)} | {list(s)} | {p} |" for n, g, s, p in views[0].shards]
    ranks = " | ".join(f"rank {view.rank} ({unit})" for view in views)
    lines += ["", f"| category | {ranks} | plan ({unit}) |", "|---|" + "---:|" * (len(views) + 1)]
    shown = set()
    for key, label in CATEGORIES.items():
        plan_key = PLANNED_AS.get(key)
        if not any(view.peak.get(key) for view in views) and not planned.get(plan_key, 0):
            continue
        shown.add(plan_key)
        plan_cell = f"{planned[plan_key] / scale:.3f}" if plan_key in planned else ""
        measured = " | ".join(f"{view.peak.get(key, 0) / scale:.3f}" for view in views)
        lines.append(f"| {label} | {measured} | {plan_cell} |")
    for plan_key, value in planned.items():  # what only the plan names (ZeRO's buckets, DDP's rebuild, ...)
        if plan_key not in shown and value:
            lines.append(f"| {plan_key} (plan only) | " + " | ".join("" for _ in views) + f" | {value / scale:.3f} |")
    totals = " | ".join(f"**{view.peak['Total'] / scale:.3f}**" for view in views)
    lines.append(f"| **peak** | {totals} | **{sum(planned.values()) / scale:.3f}** |")
    lines += ["", "Not seen by a dry run: the CUDA context, library workspaces, allocator fragmentation, NCCL's"
              " buffers, time."]
    return "\n".join(lines)
