"""What a strategy does with model state, as the planner needs it: what is sharded, what is offloaded where.

Read from a strategy object (ours, as `L.Trainer` or Hydra made it), so the plan describes the run that would
start, including a DeepSpeed config file's own stage, offload and bucket size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dist.deepspeed_config.swap_buffers import DEFAULT_PERSISTENCE_THRESHOLD
from lightning_dist.parallel.activation_checkpoint import CheckpointPlan
from lightning_dist.parallel.dims import ParallelDims

# DeepSpeed's own defaults when a config leaves them out.
_DEEPSPEED_REDUCE_BUCKET = 500_000_000
_DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
_DEEPSPEED_OFFLOAD_PARAM = {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
_DEEPSPEED_OPTIMIZER_SWAP_BUFFERS = 4


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str                        # "torch" (DDP, FSDP) or "deepspeed": they keep different copies
    shard_parameters: bool = False
    shard_gradients: bool = False
    shard_optimizer: bool = False
    keep_gathered: bool = False        # gathered parameters held from forward to backward (SHARD_GRAD_OP)
    offload_optimizer: str | None = None   # "cpu" or "nvme": optimizer state (and gradient partitions) live there
    offload_parameters: str | None = None
    activation_checkpointing: CheckpointPlan | None = None  # which blocks are recomputed in backward, and how
    reduce_bucket_elements: int = 0    # a gradient bucket made whole on the device (ZeRO's contiguous gradients)
    reduce_buckets: int = 1            # how many: two under ZeRO-1/2 with overlap_comm (one fills, one is sent)
    persistence_threshold: int = 0     # ZeRO-3 keeps parameters smaller than this whole on every rank
    sized_by_hidden_size: bool = False  # a ZeRO-3 preset: its reduce bucket follows the model's hidden size
    sub_group_size: int = 0            # ZeRO-3's optimizer tile: it steps on one flat group of this many at a time
    # ZeRO-Infinity's host buffers. The parameter swap pool (buffers, elements each): a file's, or None for a
    # preset's, sized from the model at run time; partitions kept in host memory besides it (max_in_cpu); how many
    # sub-groups of optimizer state are swapped in at once.
    parameter_swap_pool: tuple[int, int] | None = None
    parameters_in_host: int = 0
    optimizer_swap_buffers: int = 0
    replicate_across_nodes: bool = False  # HSDP: sharded within a node, one copy of the shards per node
    tensor_parallel: int = 1           # ranks that split each planned layer (FSDP + TP, DeepSpeed AutoTP)
    data_parallel_replicate: int | None = None  # groups replicating the shards; unset: per node under HSDP

    def parallel_dims(self, devices: int, num_nodes: int) -> ParallelDims:
        """How `devices` x `num_nodes` ranks hold this layout's state: replicated, sharded by all, HSDP's shards
        within a node, or split by tensor parallelism as well. Raises ValueError where the sizes do not fit."""
        world = devices * num_nodes
        if not (self.shard_parameters or self.shard_gradients or self.shard_optimizer):
            return ParallelDims(dp_replicate=world)
        return ParallelDims.of_sharding(world, num_nodes, self.tensor_parallel, self.data_parallel_replicate,
                                        self.replicate_across_nodes)


def layout_of(strategy: Any, name: str | None = None) -> Layout:
    """The layout a strategy declares (`memory_layout(name)`: each of ours does)."""
    try:
        declare = strategy.memory_layout
    except AttributeError:
        raise TypeError(f"strategy: cannot plan memory for {type(strategy).__name__}; plan one of lightning_dist's"
                        " strategies") from None
    return declare(name or type(strategy).__name__)


def fsdp_layout(strategy: Any, name: str) -> Layout:
    offload = "cpu" if strategy.cpu_offload else None
    return Layout(
        name, "torch", shard_parameters=True, shard_gradients=True, shard_optimizer=True,
        keep_gathered=not strategy.reshard_after_forward, offload_optimizer=offload, offload_parameters=offload,
        activation_checkpointing=strategy.activation_checkpointing, replicate_across_nodes=strategy.hybrid,
        tensor_parallel=strategy.tensor_parallel_size, data_parallel_replicate=strategy.data_parallel_replicate_size,
    )


def deepspeed_layout(strategy: Any, name: str) -> Layout:
    zero = strategy.config.get("zero_optimization", {})
    section = strategy.zero  # a preset's or the user's options, merged over a config file
    stage = int(section.stage)
    preset = strategy.run_config.is_preset
    param_swap = {**_DEEPSPEED_OFFLOAD_PARAM, **(zero.get("offload_param") or {})}
    optimizer_swaps = (zero.get("offload_optimizer") or {}).get("buffer_count", _DEEPSPEED_OPTIMIZER_SWAP_BUFFERS)
    contiguous = zero.get("contiguous_gradients", True)
    overlap = zero.get("overlap_comm", stage == 3)  # DeepSpeed's default: on for ZeRO-3 only
    bucket = zero.get("reduce_bucket_size", _DEEPSPEED_REDUCE_BUCKET)
    persistence = zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
    return Layout(
        # ZeRO-1 with overlap_comm reduces each gradient into its partition as backward makes it, as ZeRO-2 does
        # (DeepSpeed 0.19.8, stage_1_and_2.py; seen in a dry run): no whole gradients are kept.
        name, "deepspeed", shard_parameters=stage >= 3, shard_gradients=stage >= 2 or (stage == 1 and overlap),
        shard_optimizer=stage >= 1, offload_optimizer=section.optimizer.device,
        offload_parameters=section.parameters.device if stage >= 3 else None,
        # With contiguous gradients, each backward fills buckets made whole on the device: ZeRO-3 one, made as it
        # starts, ZeRO-1/2 one or, overlapping communication, two. "auto" is sized from the model later.
        reduce_bucket_elements=int(bucket) if stage >= 1 and contiguous and isinstance(bucket, (int, float)) else 0,
        reduce_buckets=2 if stage < 3 and overlap else 1,
        persistence_threshold=int(persistence) if stage >= 3 and isinstance(persistence, (int, float)) else 0,
        # A preset's ZeRO-3 reduce bucket follows the model's hidden size when it has one (DeepSpeedStrategy.resolution).
        sized_by_hidden_size=stage >= 3 and preset,
        # A preset's NVMe pool is sized from the model and keeps no partitions in host memory (swap_buffers.py).
        parameter_swap_pool=None if preset else (int(param_swap["buffer_count"]), int(param_swap["buffer_size"])),
        parameters_in_host=0 if preset else int(param_swap["max_in_cpu"]),
        sub_group_size=int(zero.get("sub_group_size", _DEEPSPEED_SUB_GROUP_SIZE)) if stage >= 3 else 0,
        optimizer_swap_buffers=int(optimizer_swaps),
        tensor_parallel=strategy.tensor_parallel_size,  # AutoTP
        activation_checkpointing=strategy.activation_checkpointing,
    )
