"""How much memory a run needs, per device and per node, before it is launched.

The arithmetic of ZeRO (Rajbhandari et al., 2020): mixed-precision Adam keeps per parameter 2 bytes of 16-bit
weights, 2 of 16-bit gradients and 12 of fp32 master weights and moments; ZeRO-1 shards the 12, ZeRO-2 the
gradients too, ZeRO-3 everything. What each engine really keeps differs by precision (`state_bytes`): DeepSpeed
always keeps an fp32 master copy, even of fp32 weights; torch's DDP and FSDP keep fp32 weights under autocast and
no master copy. The numbers are checked against what running ranks hold (`memory/measure.py`, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_dist.memory.layout import Layout
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.parallel import context_parallel, pipeline_layout, tensor_parallel
from lightning_dist.parallel.dims import ParallelDims

GB = 1e9  # decimal gigabytes, as in the ZeRO paper's and vendors' figures

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")


class StateBytes(NamedTuple):
    parameter: int
    gradient: int
    master: int       # fp32 copy the optimizer updates
    moment: int       # per optimizer moment


def state_bytes(fp32_master_weights: bool, precision: str, optimizer: str = "adamw") -> tuple[StateBytes, int]:
    """(bytes per parameter of each kind, number of optimizer moments)."""
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(
            f"optimizer: {optimizer!r} is not known to the planner; choose one of {', '.join(OPTIMIZER_MOMENTS)}"
        )
    moments = OPTIMIZER_MOMENTS[optimizer]
    half = precision in HALF_PRECISIONS
    if fp32_master_weights:
        return (StateBytes(2, 2, 4, 4) if half else StateBytes(4, 4, 4, 4)), moments
    if precision.endswith("-true") and half:  # the module itself in 16-bit: no fp32 copy anywhere
        return StateBytes(2, 2, 0, 2), moments
    return StateBytes(4, 4, 0, 4), moments  # fp32 weights; autocast computes in 16-bit


@dataclass
class MemoryPlan:
    layout: Layout
    precision: str
    world_size: int
    devices_per_node: int
    device: dict[str, float] = field(default_factory=dict)   # bytes per device, by category
    host: dict[str, float] = field(default_factory=dict)     # bytes per node in host memory (offload)
    nvme: dict[str, float] = field(default_factory=dict)     # bytes per node on NVMe
    # bytes per node in host memory while the ranks load pretrained weights, at set-up: before the optimizer state
    # and the offloaded parts exist, so never together with `host`
    loading: dict[str, float] = field(default_factory=dict)
    # bytes per device that exist, but not at the peak: of two parts of a step never held together (FSDP's
    # gradients and activations, DDP's bucket rebuild and activations) the peak holds the larger
    off_peak: dict[str, float] = field(default_factory=dict)
    activations_known: bool = True
    # A mixture of experts: of its trained parameters, those one token's step uses (ModelFacts.active_parameters).
    active_parameters: int | None = None
    trained_parameters: int = 0

    @property
    def model_state_per_device(self) -> float:
        return sum(self.device.get(k, 0.0) + self.off_peak.get(k, 0.0)
                   for k in ("parameters", "persistent_parameters", "gradients", "optimizer_state"))

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def host_peak(self) -> float:
        """Host memory per node at its peak: while the weights load, or while the step runs."""
        return max(self.host_total, sum(self.loading.values()))

    def table(self) -> str:
        lines = [f"Memory plan: {self.layout.name}, {self.precision}, {self.world_size} ranks "
                 f"({self.devices_per_node} per node); GB = 1e9 bytes",
                 "| where | category | GB |", "|---|---|---:|"]
        for where, categories in (
            ("per device", self.device),
            ("host, per node", self.host),
            ("NVMe, per node", self.nvme),
            ("host, per node, while the pretrained weights load", self.loading),
        ):
            rows = [f"| {where} | {name} | {value / GB:.3f} |" for name, value in categories.items() if value]
            if rows:
                lines += [*rows, f"| {where} | **total** | **{sum(categories.values()) / GB:.3f}** |"]
        lines += [
            f"| per device, not at the peak | {name} | {value / GB:.3f} |" for name, value in self.off_peak.items()
        ]
        if not self.activations_known:
            lines.append("(activations not included: no batch to trace them with)")
        if self.active_parameters is not None:  # every expert is held; a token computes with its top-k of them
            lines.append(f"(a mixture of experts: {self.trained_parameters:,} parameters trained and held,"
                         f" {self.active_parameters:,} used by each token: each layer's top-k experts and the rest;"
                         " activations traced with the tokens spread evenly over the experts)")
        if self.precision.endswith("-mixed"):
            # What a first GPU run measured above the plan (ddp, 303.6M, bf16-mixed: 13.8 GB against 11.95).
            lines.append("(activations traced in fp32 and halved: autocast keeps norms' inputs and the loss in fp32;"
                         " CUDA's allocator rounding and cuBLAS/cuDNN workspaces are not included)")
        return "\n".join(lines)


# Each parallel axis's share of a step's saved activations (its module's `activations_held`: what one of `ranks`
# ranks of the axis saves of `activations`, under the layout), applied in turn.
ACTIVATION_SHARES = (("tp", tensor_parallel.activations_held), ("cp", context_parallel.activations_held),
                     ("pp", pipeline_layout.activations_held))


def plan_memory(
    facts: ModelFacts,
    layout: Layout,
    precision: str = "32-true",
    optimizer: str | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    dims: ParallelDims | None = None,
) -> MemoryPlan:
    """The plan of one layout on `devices` x `num_nodes` ranks; `optimizer` defaults to the one the model
    configures. Sharded state is divided over the ranks that shard it (`dims.dp_shard`: every rank, or a node's
    under HSDP) and, with tensor parallelism, the layers it splits over the ranks that split them (`dims.tp`; a
    block's parameters are nearly all in them) and the activations it splits by the same rule as Megatron-LM's."""
    dims = dims or layout.parallel_dims(devices, num_nodes)
    world = dims.world_size
    size, moments = state_bytes(layout.fp32_master_weights, precision, optimizer or facts.optimizer)
    # Weights are held for every parameter; gradients and optimizer state only for those that train (a LoRA model's
    # adapters, not its base).
    held, trained = _elements_per_rank(facts, dims)

    # FSDP shards over the data-parallel ranks that shard and, under context parallelism, its ranks too (they hold
    # no weights of their own: torchtitan's dp_shard_cp).
    shards = dims.dp_shard * dims.cp

    def shard(count: float, sharded: bool) -> float:
        return math.ceil(count / shards) if sharded else count

    gradients_offload = layout.offload_optimizer if layout.shard_gradients else None
    host_gradient = size.gradient
    if layout.host_gradient_copies and gradients_offload:
        # The host optimizer steps on fp32 copies of the gradient partitions, which stay in the gradient dtype
        # beside them (a dry run of every offload preset shows both).
        host_gradient = size.gradient + size.master
    weight_bytes = held * size.parameter - _frozen_16bit(facts, held) * (size.parameter - 2)
    parameters = shard(weight_bytes, layout.shard_parameters)
    gradients = shard(trained * host_gradient, layout.shard_gradients)
    optimizer_state = shard(trained * (size.master + moments * size.moment), layout.shard_optimizer)
    plan = MemoryPlan(layout, precision, world, devices, active_parameters=facts.active_parameters,
                      trained_parameters=facts.parameters)

    # Where each part lives: the device unless offloaded; offloaded parts add up over a node's ranks. DeepSpeed
    # keeps gradient partitions in host memory when the optimizer state is on NVMe: it swaps only the latter.
    placements = (
        ("parameters", parameters, layout.offload_parameters),
        ("gradients", gradients, "cpu" if gradients_offload == "nvme" else gradients_offload),
        ("optimizer_state", optimizer_state, layout.offload_optimizer),
    )
    for name, value, offload in placements:
        if offload is None:
            plan.device[name] = value
        else:
            (plan.host if offload == "cpu" else plan.nvme)[name] = value * devices
    plan.host.update(_swap_buffers(facts, layout, size, shards, devices))
    if facts.pretrained_largest:
        # Each rank reads one tensor at a time out of the folder, in the run's dtype: under FSDP2 and ZeRO-3 only
        # its rows of it (its shard, or those that hold its partition), which it holds once beside what it keeps;
        # elsewhere the whole tensor, about twice (the copy, and the file's pages it was read from). Measured in
        # BENCHMARKS.md. Not counted: each process's own memory (0.46 GB measured, and 0.03 GB of set-up).
        largest = facts.pretrained_largest
        read = math.ceil(largest / shards) if layout.pretrained_read_by_shard else 2 * largest
        plan.loading["pretrained_tensors"] = read * size.parameter * devices
    if layout.offload_staging_buffer and gradients_offload:
        # ZeRO-1/2 move each gradient to the host through a buffer the size of the largest parameter, one on the
        # device and one pinned in host memory.
        staging = max(facts.parameter_sizes, default=0) * size.gradient
        plan.device["offload_staging_buffer"] = staging
        plan.host["offload_staging_buffer"] = staging * devices
    if layout.persistence_threshold:
        # Once ZeRO-3 has traced a step it keeps its small parameters whole on every rank, beside their partitions
        # (a dry run sees it release them as a step ends, and gather them again).
        persistent = sum(numel for numel in facts.parameter_sizes if numel < layout.persistence_threshold)
        plan.device["persistent_parameters"] = persistent * size.parameter - _frozen_16bit(facts, persistent) * (
            size.parameter - 2)

    compute_bytes = 2 if precision in HALF_PRECISIONS else 4
    if layout.shard_parameters or layout.offload_parameters:
        # Whole parameters exist only while used: one block and the next, prefetched; all of them under
        # SHARD_GRAD_OP, which keeps them from forward to backward.
        gathered = held if layout.keep_gathered else 2 * (math.ceil(_gathered_unit(facts, dims) / dims.tp) or held)
        plan.device["gathered_parameters"] = min(gathered, held) * compute_bytes
    if layout.autocast_weight_copies and precision in ("bf16-mixed", "16-mixed"):
        # Autocast casts each fp32 weight to 16 bits as forward uses it and keeps the copy: matrix products save
        # their inputs for backward. At backward's start every weight has its copy (the dry run shows them).
        plan.device["autocast_weight_copies"] = held * 2
    if layout.bucket_rebuild:
        # DDP rebuilds its gradient buckets at the start of the second step, in the order gradients arrived: the
        # new buckets are allocated while the old ones (the gradients themselves, as bucket views) still exist.
        plan.device["bucket_rebuild"] = trained * size.gradient
    bucket = layout.reduce_bucket_elements
    if layout.bucket_from_hidden_size and facts.hidden_size:
        bucket = layout.bucket_from_hidden_size(facts.hidden_size)
    if bucket:
        plan.device["gradient_bucket"] = layout.reduce_buckets * bucket * size.gradient
    if layout.sub_group_size and not layout.offload_optimizer:
        # ZeRO-3 steps on one flat fp32 group at a time: a copy of its gradients, and torch Adam's temporaries
        # (sqrt of the second moment, divided), each the size of the group. (Offloaded, DeepSpeed's CPU Adam needs
        # no temporaries, and the copy is made in host memory.)
        tile = min(layout.sub_group_size, math.ceil(trained / shards))
        plan.device["optimizer_step"] = tile * (size.master + 2 * size.moment)
    plan.device["buffers"] = facts.buffer_bytes
    activations: float | None = facts.activations_under(layout.activation_checkpointing)
    plan.activations_known = activations is not None
    for axis, held_by_a_rank in ACTIVATION_SHARES:  # each axis's share of what its group's ranks save
        if activations and (ranks := getattr(dims, axis)) > 1:
            activations = held_by_a_rank(activations, ranks, layout)
    # Traced in fp32; a 16-bit run saves (about) half.
    plan.device["activations"] = (activations or 0) * compute_bytes / 4
    if layout.reduce_scatter_per_block:
        # FSDP2 reduce-scatters each block's whole gradients from a buffer of their own, while the next block
        # computes; its sharded gradients appear block by block as backward frees the activations.
        plan.device["reduce_scatter_buffer"] = (math.ceil(_gathered_unit(facts, dims) / dims.tp) or trained) \
            * size.gradient
        _never_together(plan, ("activations",), ("gradients",))
    if dims.pp > 1:
        _pipeline_stage_state(plan, facts, layout, held, trained, size.gradient, compute_bytes)
    if "bucket_rebuild" in plan.device:
        # DDP rebuilds its buckets as the second step starts, before forward has saved anything.
        _never_together(plan, ("activations", "autocast_weight_copies"), ("bucket_rebuild",))
    return plan


def _elements_per_rank(facts: ModelFacts, dims: ParallelDims) -> tuple[int, int]:
    """(parameter elements, trainable elements) a rank's layers hold before any sharding: the layers tensor
    parallelism splits are split, the rest whole; under pipeline stages, a stage's share."""
    trained_split = facts.parameters if facts.tensor_parallel_parameters is None else facts.tensor_parallel_parameters
    frozen_split = facts.frozen_parameters if facts.tensor_parallel_parameters is None else facts.tensor_parallel_frozen
    total = facts.parameters + facts.frozen_parameters
    trained = facts.parameters - trained_split + math.ceil(trained_split / dims.tp)
    held = total - trained_split - frozen_split + math.ceil((trained_split + frozen_split) / dims.tp)
    if dims.pp > 1:
        # A stage holds its share of the blocks and, the first or the last, what lies outside them: the embedding,
        # or the final norm and the head (a tied head is a copy of the embedding there). What trains is taken to be
        # spread as the parameters are (LoRA's adapters are in every block; the frozen embedding is then counted as
        # trainable on its stage: the plan errs high).
        outside = min(max(total - facts.largest_block * facts.blocks, 0), held)
        stage = math.ceil((held - outside) / dims.pp) + outside
        if held:
            trained = min(trained, math.ceil(stage * trained / held))
        held = stage
    return held, trained


def _frozen_16bit(facts: ModelFacts, held: int) -> int:
    """Of the `held` elements of a rank, those frozen in 16 bits (their share of the model's): every engine keeps a
    frozen weight as loaded where the precision holds the others in float32 (a LoRA base in its bf16)."""
    total = facts.parameters + facts.frozen_parameters
    return math.ceil(facts.frozen_16bit_parameters * held / total) if total else 0


def _gathered_unit(facts: ModelFacts, dims: ParallelDims) -> int:
    """Elements of the largest block as it is gathered: under expert parallelism its experts are a unit of their own,
    of which each rank gathers the experts it holds, 1 / ep of them."""
    experts = facts.largest_block_experts
    return facts.largest_block - experts + math.ceil(experts / dims.ep)


def _pipeline_stage_state(plan: MemoryPlan, facts: ModelFacts, layout: Layout, held: int, trained: int,
                          gradient_bytes: int, compute_bytes: int) -> None:
    """What torch's pipeline stages hold beyond a step's usual state. Under FSDP a stage is not resharded between
    its microbatches' backward passes and its gradients are not reduced until the last (torch's schedules reduce
    them once, at the step's end): from its first backward the stage holds every parameter gathered and every
    gradient unsharded, accumulated in the gradients' dtype (a dry run shows both, a stage's whole). And each stage
    keeps a receive buffer per microbatch for what crosses its boundaries."""
    if layout.reduce_scatter_per_block:
        plan.device["gathered_parameters"] = held * compute_bytes
        plan.device["accumulated_gradients"] = trained * gradient_bytes
    boundary = facts.block_activations[0].inputs if facts.block_activations else 0
    plan.device["pipeline_buffers"] = layout.pipeline_receive_buffers * boundary * compute_bytes / 4


def _never_together(plan: MemoryPlan, first: tuple[str, ...], second: tuple[str, ...]) -> None:
    """Two groups of a step's memory that are never held at once (as a dry run's memory tracker shows): the peak
    holds the larger; the other is listed off the peak."""
    held = [sum(plan.device.get(key, 0.0) for key in group) for group in (first, second)]
    for key in second if held[0] >= held[1] else first:
        if key in plan.device:
            plan.off_peak[key] = plan.device.pop(key)


def _swap_buffers(
    facts: ModelFacts, layout: Layout, size: StateBytes, partitions: int, devices: int
) -> dict[str, float]:
    """ZeRO-Infinity's host memory per node: the buffers partitions are swapped through, and the parameter
    partitions a config keeps in host memory besides (`max_in_cpu`)."""
    host: dict[str, float] = {}
    partition = math.ceil((facts.parameters + facts.frozen_parameters) / partitions)
    if layout.offload_parameters == "nvme":
        pool = layout.parameter_swap_pool
        if pool is None and layout.swap_pool_sizer:
            pool = layout.swap_pool_sizer(facts.parameter_sizes, facts.most_parameters_per_module, partitions,
                                          size.parameter, layout.persistence_threshold)
        pool = pool or (0, 0)
        host["parameter_swap_buffers"] = pool[0] * pool[1] * size.parameter * devices
        host["parameters_kept_in_host"] = min(layout.parameters_in_host, partition) * size.parameter * devices
    if layout.offload_optimizer == "nvme":
        tile = min(layout.sub_group_size, math.ceil(facts.parameters / partitions))
        host["optimizer_swap_buffers"] = layout.optimizer_swap_buffers * tile * size.master * devices
    return host
