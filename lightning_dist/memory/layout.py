"""What a strategy does with model state, as the planner needs it: what is sharded, what is offloaded where.

Read from a strategy object (ours, as `L.Trainer` or Hydra made it), so the plan describes the run that would
start, including a DeepSpeed config file's own stage, offload and bucket size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dist.parallel.activation_checkpoint import CheckpointPlan
from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.sizes import ParallelSizes


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str                        # which engine's layout this is: a label, never read by the planner
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
    bucket_from_hidden_size: Callable[[int], int] | None = None  # a ZeRO-3 preset: its bucket from the hidden size
    sub_group_size: int = 0            # ZeRO-3's optimizer tile: it steps on one flat group of this many at a time
    # ZeRO-Infinity's host buffers. The parameter swap pool (buffers, elements each): a file's, or None for a
    # preset's, sized from the model at run time by `swap_pool_sizer` (the parameters' sizes, the most parameters a
    # module owns, the partitions, bytes per element, the persistence threshold -> the pool, or None); partitions
    # kept in host memory besides it (max_in_cpu); how many sub-groups of optimizer state are swapped in at once.
    parameter_swap_pool: tuple[int, int] | None = None
    swap_pool_sizer: Callable[[Sequence[int], int, int, int, int], tuple[int, int] | None] | None = None
    parameters_in_host: int = 0
    optimizer_swap_buffers: int = 0
    # The parallel axes' sizes: tensor (FSDP + TP, DeepSpeed AutoTP), context (each rank holds its shard of a
    # sequence's activations), pipeline (stages, each on its own ranks, each holding its share of the blocks), HSDP's
    # replication of the shards.
    sizes: ParallelSizes = ParallelSizes()
    # How the engine keeps and moves its state, where engines differ (each slice's `memory_layout` says):
    fp32_master_weights: bool = False  # 16-bit parameters and gradients beside fp32 master weights (ZeRO)
    host_gradient_copies: bool = False  # an offloaded step keeps fp32 copies of the gradient partitions (ZeRO)
    offload_staging_buffer: bool = False  # offloaded gradients pass through a buffer of the largest parameter
    autocast_weight_copies: bool = False  # autocast keeps a 16-bit copy of each whole weight used (DDP)
    bucket_rebuild: bool = False       # gradient buckets rebuilt at the second step, beside the old ones (DDP)
    reduce_scatter_per_block: bool = False  # a block's whole gradients reduce-scattered from their own buffer (FSDP2)
    pretrained_read_by_shard: bool = False  # each rank reads its rows of a pretrained tensor alone (FSDP2, ZeRO-3)
    # The share of a batch's activations the busiest stage holds at once: the microbatches in flight there (GPipe
    # all of them, 1F1B at most one per stage) over the microbatches.
    pipeline_in_flight: float = 1.0
    # The buffers, each a batch's activations at a stage boundary, that the busiest rank's stages keep between steps:
    # one per microbatch for what a stage receives from the one before, one for the gradients from the one after.
    pipeline_receive_buffers: int = 0

    def parallel_dims(self, devices: int, num_nodes: int) -> ParallelDims:
        """How `devices` x `num_nodes` ranks hold this layout's state: replicated, sharded by all, HSDP's shards
        within a node, or split by tensor parallelism as well. Raises ValueError where the sizes do not fit."""
        world = devices * num_nodes
        if not (self.shard_parameters or self.shard_gradients or self.shard_optimizer):
            return ParallelDims(dp_replicate=world)
        return self.sizes.dims(devices, num_nodes)


def layout_of(strategy: Any, name: str | None = None) -> Layout:
    """The layout a strategy declares (`memory_layout(name)`: each of ours does)."""
    try:
        declare = strategy.memory_layout
    except AttributeError:
        raise TypeError(f"strategy: cannot plan memory for {type(strategy).__name__}; plan one of lightning_dist's"
                        " strategies") from None
    return declare(name or type(strategy).__name__)
