"""Expert parallelism (`strategy.expert_parallel_size`): the experts of each mixture-of-experts layer split over a
group of ranks, each rank holding experts / size of them, the tokens sent to their experts and the outputs back by
all-to-all (dispatch.py). The group is taken from the ranks FSDP shards over (torchtitan's layout): their batches
differ, so each expert sees the tokens of size ranks; the experts are then sharded over the ranks left to them
(parallel/dims.py). Which modules are split and how: layers.py; the axis on a rank, and its per-step check:
axis.py."""

from typing import Any

from lightning_dist.parallel.expert_parallel.axis import ExpertParallel
from lightning_dist.parallel.expert_parallel.layers import KEY, experts_modules, refusal

__all__ = ["KEY", "ExpertParallel", "experts_modules", "model_unsplit", "refusal"]


def model_unsplit(facts: Any, size: int) -> str | None:
    """Why a model's experts cannot be split over `size` ranks (auto_fit's fsdp_ep), read from its facts
    (memory/model_facts.py), or None."""
    if not facts.fewest_experts:
        return "the model has no mixture-of-experts layers to split"
    if facts.fewest_experts % size:
        return f"its layers' {facts.fewest_experts} experts do not divide over {size} expert-parallel ranks"
    return None
