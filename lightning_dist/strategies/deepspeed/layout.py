"""DeepSpeed's ZeRO in the planner's terms (memory/layout.py): what each stage shards, offloads and buckets, read
from the config the run would start with, a file's own stage, offload and bucket sizes included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_dist.memory.layout import Layout
from lightning_dist.strategies.deepspeed.config.resolve import HIDDEN_SIZE_RULES
from lightning_dist.strategies.deepspeed.config.swap_buffers import DEFAULT_PERSISTENCE_THRESHOLD, parameter_swap_pool

# DeepSpeed's own defaults when a config leaves them out.
_DEEPSPEED_REDUCE_BUCKET = 500_000_000
_DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
_DEEPSPEED_OFFLOAD_PARAM = {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
_DEEPSPEED_OPTIMIZER_SWAP_BUFFERS = 4


def zero_layout(strategy: Any, name: str) -> Layout:
    """The layout of `strategy` (a DeepSpeedStrategy): its options merged over its config file."""
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
        name,
        "deepspeed",
        shard_parameters=stage >= 3,
        pretrained_read_by_shard=stage >= 3,  # the rows that hold a rank's partition (engine.zero3_partitioner)
        shard_gradients=stage >= 2 or (stage == 1 and overlap),
        shard_optimizer=stage >= 1,
        offload_optimizer=section.optimizer.device,
        offload_parameters=section.parameters.device if stage >= 3 else None,
        # With contiguous gradients, each backward fills buckets made whole on the device: ZeRO-3 one, made as it
        # starts, ZeRO-1/2 one or, overlapping communication, two. "auto" is sized from the model later.
        reduce_bucket_elements=int(bucket) if stage >= 1 and contiguous and isinstance(bucket, (int, float)) else 0,
        reduce_buckets=2 if stage < 3 and overlap else 1,
        persistence_threshold=int(persistence) if stage >= 3 and isinstance(persistence, (int, float)) else 0,
        # A preset's ZeRO-3 reduce bucket follows the model's hidden size when it has one
        # (DeepSpeedStrategy.resolution).
        bucket_from_hidden_size=HIDDEN_SIZE_RULES["reduce_bucket_size"] if stage >= 3 and preset else None,
        # A preset's NVMe pool is sized from the model and keeps no partitions in host memory (swap_buffers.py).
        parameter_swap_pool=None if preset else (int(param_swap["buffer_count"]), int(param_swap["buffer_size"])),
        swap_pool_sizer=_swap_pool,
        parameters_in_host=0 if preset else int(param_swap["max_in_cpu"]),
        sub_group_size=int(zero.get("sub_group_size", _DEEPSPEED_SUB_GROUP_SIZE)) if stage >= 3 else 0,
        optimizer_swap_buffers=int(optimizer_swaps),
        sizes=strategy.parallel_sizes,  # AutoTP's tensor-parallel groups, Ulysses' sequence-parallel ones
        activation_checkpointing=strategy.activation_checkpointing,
        fp32_master_weights=True,
        host_gradient_copies=True,
        offload_staging_buffer=stage < 3,  # ZeRO-1/2 move each gradient to the host; ZeRO-3's partitions go whole
    )


def _swap_pool(sizes: Sequence[int], most_per_module: int, partitions: int, element_size: int,
               persistence_threshold: int) -> tuple[int, int] | None:
    """A preset's NVMe pool as the run sizes it from the model (config/swap_buffers.py): (buffers, elements each)."""
    pool = parameter_swap_pool(sizes, most_per_module, partitions, element_size, persistence_threshold)
    return (pool.buffer_count, pool.buffer_size) if pool else None
