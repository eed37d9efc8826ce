"""A dry run at the world size you will launch (`dry_run=true`): the strategy's own set-up and two training steps,
seen from one rank of `devices x num_nodes`, in this one process, with nothing allocated and nothing sent.

torch's fake process group completes every collective without sending anything, and fake tensors have shapes and
devices but no storage. The model is built on the meta device and set up by the strategy itself (FSDP: its mesh,
tensor parallelism, activation checkpointing and FSDP2's sharding, then fake storage for the shards; DDP: its
wrapper); torch's memory trackers follow the second step (the first counts DTensor temporaries at their global
shape) and report the rank's peak by category. Fake tensors live on `cuda:<local rank>` for a GPU run (on this
machine's CUDA, or with CUDA faked: `_compat/fake_cuda.py`) and every op and collective is device-checked
(`parallel/device_check.py`); else on the host. What a dry run cannot see: the CUDA context, library workspaces,
allocator fragmentation, NCCL's buffers, and time.

Each strategy replays its own rank (`dry_run_rank`, strategies/base.py): ddp and the fsdp presets (FULL_SHARD,
SHARD_GRAD_OP, HYBRID_SHARD, activation checkpointing, tensor parallelism, CPU offload) in strategies/torch/dry_run.py,
DeepSpeed's ZeRO 1-3 and its offload in strategies/deepspeed/dry_run.py. Here: the ranks, the fake cluster, the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from lightning_dist._compat.fake_cuda import FakeCudaUnavailable, run_with_fake_cuda, shim_library
from lightning_dist.memory.auto_fit import AutoFit
from lightning_dist.memory.routed_experts import experts_traced_on_meta
from lightning_dist.parallel.classes import block_modules

log = logging.getLogger(__name__)

# The tracker's categories, as the table names them, in the order a reader adds them up.
CATEGORIES = {
    "SHARDED_PARAM": "sharded parameters", "UNSHARDED_PARAM": "gathered parameters", "BUFFER": "buffers",
    "SHARDED_GRAD": "sharded gradients", "UNSHARDED_GRAD": "gathered gradients", "OPT": "optimizer state",
    "ALL_GATHER": "all-gather buffers", "REDUCE_SCATTER": "reduce-scatter buffers", "ACT": "activations",
    "TEMP": "temporaries", "INP": "inputs", "PARAM": "parameters", "GRAD": "gradients",
    "OTH": "gradient buckets",  # what the dry run gives the module tracker itself: DDP's buckets
    "ENGINE_BUFFERS": "DeepSpeed's buffers",  # its gradient buckets above all (strategies/deepspeed/dry_run.py)
}


# Where a replay's own map puts a tracker category beside a plan category of its own, the row says what it holds.
PLAN_LABELS = {"pipeline_buffers": "pipeline receive buffers",
               "accumulated_gradients": "temporaries (gradients accumulated whole)"}


Shard = tuple[str, tuple[int, ...], tuple[int, ...], str]  # name, global shape, local shape, placements


# The plan's categories beside the memory tracker's that count the same bytes, as torch's trackers name them; an
# engine whose replay names categories of its own gives its views its own map.
PLANNED_AS = {"SHARDED_PARAM": "parameters", "SHARDED_GRAD": "gradients", "OPT": "optimizer_state",
              "PARAM": "parameters", "OTH": "gradients", "REDUCE_SCATTER": "reduce_scatter_buffer",
              "UNSHARDED_PARAM": "gathered_parameters", "BUFFER": "buffers", "ACT": "activations"}


@dataclass(frozen=True)
class RankView:
    """One rank of the dry run: where it sits in the mesh, what it holds of each parameter, its peak by category."""

    rank: int
    coordinate: dict[str, int]
    shards: list[Shard]
    peak: dict[str, int]  # bytes on the rank's device, by CATEGORIES' key, and "Total"
    host: int = 0  # bytes in host memory at its peak (offloaded state), where the device is not the host
    planned_as: dict[str, str] = field(default_factory=lambda: PLANNED_AS)  # the plan's category of each of peak's


def dry_run_refusal(strategy: Any) -> str | None:
    """Why the dry run cannot replay `strategy`, or None: each of ours says (its `dry_run_refusal`, as configured);
    any other strategy is not dry-run."""
    try:
        return strategy.dry_run_refusal
    except AttributeError:
        return f"{type(strategy).__name__} is not one of lightning_dist's strategies"


def can_dry_run(strategy: Any) -> bool:
    """Whether `dry_run_ranks` knows the strategy: every one of ours (not yet: DeepSpeed's AutoTP, which needs a
    Hugging Face model)."""
    return dry_run_refusal(strategy) is None


def dry_run_configured(strategy_config: dict, module_config: dict, batch: Any, precision: str, devices: int,
                       num_nodes: int, ranks: tuple[int, ...], device_type: str) -> list[RankView]:
    """`dry_run_ranks` from configurations (plain containers, so that it can run in a process with CUDA faked)."""
    from hydra.utils import instantiate

    strategy = instantiate(strategy_config, _convert_="all")
    build = partial(instantiate, module_config, _convert_="all")
    return dry_run_ranks(strategy, build, batch, precision, devices, num_nodes, ranks, device_type)


def dry_run_devices(accelerator: str, devices: int) -> tuple[str, Callable[..., Any], str]:
    """Where the dry run's fake tensors live, how to run it, and what to say about it: on `cuda` for a GPU run
    (on this machine's CUDA, else with CUDA faked in a process of its own), else on `cpu`. Where CUDA cannot be
    faked, CPU fakes: the same bytes, without the device checks."""
    if accelerator not in ("gpu", "cuda"):
        return "cpu", _in_this_process, "on fake CPU devices"
    if torch.cuda.is_available():
        return "cuda", _in_this_process, "on fake tensors on this machine's CUDA"
    try:
        shim_library(devices)
    except FakeCudaUnavailable as why:
        return "cpu", _in_this_process, f"on fake CPU devices: CUDA cannot be faked here ({why})"
    return "cuda", partial(run_with_fake_cuda, devices=devices), "on fake CUDA devices (this machine has none)"


def _in_this_process(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


def dry_run(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str = "32-true", devices: int = 1,
            num_nodes: int = 1, ranks: Sequence[int] | None = None, accelerator: str = "gpu") -> list[RankView]:
    """The dry run for plain Lightning: `strategy` (ours, as given to `L.Trainer`) sets up the module `build()`
    returns and trains it two steps on `batch`, as each of `ranks` (default: the first and the last) of `devices`
    per node on `num_nodes` nodes, on fake devices. For `accelerator="gpu"` on a machine without CUDA, CUDA is
    faked in a process of its own: `strategy`, `build` (a class, or a function importable by name) and `batch`
    travel there by pickle."""
    world = devices * num_nodes
    ranks = tuple(dict.fromkeys(ranks if ranks is not None else (0, world - 1)))
    if any(not 0 <= rank < world for rank in ranks):
        raise ValueError(f"ranks={list(ranks)}: global ranks of this run are 0 to {world - 1}")
    if refusal := dry_run_refusal(strategy):
        raise ValueError(f"{refusal}; DDPStrategy, FSDPStrategy and DeepSpeedStrategy (without AutoTP) are dry-run")
    device_type, run, where = dry_run_devices(accelerator, devices)
    log.info(f"Dry run {where}")
    return run(dry_run_ranks, strategy, build, batch, precision, devices, num_nodes, ranks, device_type)


def dry_run_ranks(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int,
                  num_nodes: int, ranks: tuple[int, ...], device_type: str = "cpu") -> list[RankView]:
    """Each of `ranks` (global ranks of devices x num_nodes) set up by `strategy` and trained two steps on `batch`,
    on fake `device_type` devices (`cuda` needs CUDA, real or faked: `_compat/fake_cuda.py`). A mixture of experts'
    layers run their experts on their rows without the routing's values, which fake tensors do not have, as the
    plan's trace does (memory/routed_experts.py)."""
    with ExitStack() as routed:
        def built() -> nn.Module:
            model = build()
            routed.enter_context(experts_traced_on_meta(model))
            return model

        return [strategy.dry_run_rank(built, batch, precision, devices, num_nodes, rank, device_type)
                for rank in ranks]


class FakeRankEnvironment(LightningEnvironment):
    """Rank `rank` of `devices` per node: what the strategy asks of its cluster, answered without one. The other
    ranks are never started (a Trainer given this launches nothing)."""

    def __init__(self, rank: int, devices: int, world_size: int) -> None:
        super().__init__()
        self.set_global_rank(rank)
        self.set_world_size(world_size)
        self.devices = devices

    def local_rank(self) -> int:
        return self.global_rank() % self.devices

    def node_rank(self) -> int:
        return self.global_rank() // self.devices

    @property
    def creates_processes_externally(self) -> bool:
        return True


def as_rank(strategy: Any, rank: int, devices: int, num_nodes: int, device_type: str) -> None:
    """Make `strategy` rank `rank` of `devices` per node on `num_nodes` nodes, with fake `device_type` devices."""
    strategy.cluster_environment = FakeRankEnvironment(rank, devices, devices * num_nodes)
    strategy.num_nodes = num_nodes
    strategy.parallel_devices = [torch.device(device_type, index) if device_type == "cuda" else torch.device("cpu")
                                 for index in range(devices)]


def shards_of(model: nn.Module, block_classes: tuple[type[nn.Module], ...],
              partition_row: Callable[[str, nn.Parameter], Shard | None] = lambda name, parameter: None) -> list[Shard]:
    """Every parameter outside the repeated blocks, and those of the first block: the other blocks repeat it.
    `partition_row`: the row of a parameter an engine partitions in its own way (ZeRO-3), None for the others."""
    blocks = block_modules(model, block_classes)
    others = tuple(f"{name}." for name, module in model.named_modules() if module in blocks[1:])
    rows = []
    for name, parameter in model.named_parameters():
        if name.startswith(others):
            continue
        if (row := partition_row(name, parameter)) is not None:
            rows.append(row)
            continue
        shard = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        placements = ", ".join(str(p) for p in getattr(parameter, "placements", ())) or "whole"
        rows.append((name, tuple(parameter.shape), tuple(shard.shape), placements))
    return rows


HEADROOM = AutoFit.headroom  # of a device's memory: what a plan or a dry run may fill


def table(views: list[RankView], name: str, precision: str, devices: int, num_nodes: int,
          planned: dict[str, float], where: str = "on fake CPU devices", planned_host: float = 0.0,
          device_memory_gb: float = 80.0, planned_nvme: float = 0.0) -> str:
    """The dry run's report: mesh coordinates, the first rank's shards, and each rank's peak beside the plan
    (`planned`: bytes per device by the plan's categories; `planned_host`, `planned_nvme`: bytes per rank)."""
    world = devices * num_nodes
    unit, scale = ("GB", 1e9) if max(view.peak["Total"] for view in views) >= 1e9 else ("MB", 1e6)
    lines = [f"Dry run: {name}, {precision}, {world} ranks ({devices} per node) {where}: nothing allocated,"
             f" nothing sent; {unit} = 1e{len(str(int(scale))) - 1} bytes"]
    lines += [f"rank {v.rank}: " + ", ".join(f"{axis}={index}" for axis, index in v.coordinate.items()) for v in views]
    lines += ["", f"| parameter | global shape | rank {views[0].rank}'s shard | placement |", "|---|---|---|---|"]
    lines += [f"| {n} | {list(g)} | {list(s)} | {p} |" for n, g, s, p in views[0].shards]
    ranks = " | ".join(f"rank {view.rank} ({unit})" for view in views)
    lines += ["", f"| category | {ranks} | plan ({unit}) |", "|---|" + "---:|" * (len(views) + 1)]
    shown = set()
    planned_as = views[0].planned_as
    for key, label in CATEGORIES.items():
        plan_key = planned_as.get(key, "")
        label = PLAN_LABELS.get(plan_key, label)
        tracked = any(key in view.peak for view in views)  # FSDP's tracker and the module tracker differ
        if not tracked or (not any(view.peak.get(key) for view in views) and not planned.get(plan_key, 0)):
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
    if any(view.host for view in views) or planned_host:
        hosts = " | ".join(f"{view.host / scale:.3f}" for view in views)
        lines.append(f"| host memory (offloaded state) | {hosts} | {planned_host / scale:.3f} |")
    if planned_nvme:  # DeepSpeed's swaps to NVMe are native I/O on real buffers: traced as host offload instead
        lines.append("| NVMe (offloaded state) | " + " | ".join("in host memory" for _ in views) +
                     f" | {planned_nvme / scale:.3f} |")
    usable = HEADROOM * device_memory_gb * 1e9
    highest = max(view.peak["Total"] for view in views)
    verdict = "fits" if highest <= usable else "does not fit"
    lines += ["", f"Verdict on {device_memory_gb:g} GB devices (dry_run_device_memory_gb), {HEADROOM:.0%} usable:"
              f" {verdict} ({highest / 1e9:.2f} of {usable / 1e9:.2f} GB).",
              *(["NVMe offload is traced as host offload (a dry run writes no files): the host row holds what the"
                 " drive would."] if planned_nvme else []),
              f"Not seen by a dry run (the other {1 - HEADROOM:.0%}): the CUDA context, library workspaces, allocator"
              " fragmentation, NCCL's buffers; nor time."]
    return "\n".join(lines)
