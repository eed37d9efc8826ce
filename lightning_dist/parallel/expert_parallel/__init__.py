"""Expert parallelism (`strategy.expert_parallel_size`): the experts of each mixture-of-experts layer split over a
group of ranks, each rank holding experts / size of them, the tokens sent to their experts and the outputs back by
all-to-all (dispatch.py). The group is taken from the ranks FSDP shards over (torchtitan's layout): their batches
differ, so each expert sees the tokens of size ranks; the experts are then sharded over the ranks left to them
(parallel/dims.py). Which modules are split and how: layers.py; the axis on a rank, and its per-step check:
axis.py."""

from lightning_dist.parallel.expert_parallel.axis import ExpertParallel
from lightning_dist.parallel.expert_parallel.layers import KEY, experts_modules, refusal

__all__ = ["KEY", "ExpertParallel", "experts_modules", "refusal"]
