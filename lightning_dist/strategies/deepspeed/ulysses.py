"""DeepSpeed's own Ulysses under ZeRO: the ranks of a sequence-parallel group each hold a shard of every sequence
(parallel/context_parallel.py gives each step its shard, the positions to match, and averages what it logs), and
attention is exchanged by DeepSpeed's `DistributedAttention` (`deepspeed.sequence.layer`): heads for the sequence
before the model's attention call, and back after it, with its all-to-all (`deepspeed.comm`) in forward and backward.

ZeRO runs over every rank, as its data-parallel group, and averages the gradients over it: each rank's loss is its
shard's mean, so the average over a group's shards is the whole sequence's. (DeepSpeed's engine would sum over the
group instead when given a sequence-parallel `mpu`, for losses that are already the whole sequence's; none is given.)
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_dist.parallel.context_parallel import ContextParallel
from lightning_dist.parallel.dims import CONTEXT_PARALLEL

# DeepSpeed's layout around attention: (batch, sequence, heads, head dim); the model's is (batch, heads, sequence, dim).
_BATCH, _SEQUENCE, _HEADS = 0, 1, 2


def sequence_parallel_group(strategy: Any) -> Any:
    """The process group of this rank's sequence-parallel ranks, from the mesh of the strategy's dimensions (a
    collective: every rank calls it)."""
    return strategy.parallel_dims.build_mesh(strategy.root_device.type)[CONTEXT_PARALLEL].get_group()


def deepspeed_ulysses(strategy: Any, group: Any) -> ContextParallel:
    """This rank's part of its sequence-parallel `group`."""
    from deepspeed.sequence.layer import DistributedAttention  # importing DeepSpeed takes seconds

    dims = strategy.parallel_dims
    # The model's attention runs between DeepSpeed's two exchanges, on the whole sequence for heads / cp of its heads.
    exchanged = DistributedAttention(_attend_in_model_layout, group, scatter_idx=_HEADS, gather_idx=_SEQUENCE)

    def exchange(query: Any, key: Any, value: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
        output = exchanged(*(t.transpose(1, 2) for t in (query, key, value)), _BATCH, None, attend=attend)
        return output.transpose(1, 2)

    return ContextParallel(group, dims.coordinates(strategy.global_rank)["cp"], dims.cp, strategy.root_device,
                           exchange=exchange)


def _attend_in_model_layout(query: Any, key: Any, value: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
    return attend(*(t.transpose(1, 2) for t in (query, key, value))).transpose(1, 2)
