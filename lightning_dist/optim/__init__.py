"""Optimizers and learning-rate schedules chosen by config: the `optimizer/` and `scheduler/` groups."""

from lightning_dist.optim.configured import DEFAULT_OPTIMIZER, ConfiguredOptimizers, require_shardable_optimizer
from lightning_dist.optim.parameter_groups import decay_groups

__all__ = ["ConfiguredOptimizers", "DEFAULT_OPTIMIZER", "decay_groups", "require_shardable_optimizer"]
