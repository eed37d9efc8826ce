"""Each strategy's bases, in their order: the mixins' hooks call on through `super()`, so their order is how they
nest around Lightning's own strategy (compile reports outermost; background saves hand their write to swapped saves,
which put it in place whole; the logged rows' step labels; a model never built forgotten at teardown). The order is
StrategyBase's, one for every strategy (strategies/base.py); a reordering changes behaviour without failing any single
mixin's test: this pins it."""

from __future__ import annotations

import pytest

import lightning_dist.strategies as strategies

BASE = ["lightning_dist.strategies.base.StrategyBase",
        "lightning_dist.parallel.regional_compile.ReportsCompilation",
        # Its record of what the train loaders read goes into every save, background or not.
        "lightning_dist.data.train_loader_place.ContinuesTrainLoaders",
        # A save without the frozen weights (their fingerprints instead), background or not.
        "lightning_dist.checkpoints.frozen_weights.LeavesFrozenWeightsOut",
        "lightning_dist.checkpoints.background.BackgroundSaves",
        "lightning_dist.checkpoints.swap.SwappedSaves",
        "lightning_dist.checkpoints.logged_steps.LogsGlobalSteps",
        "lightning_dist.parallel.sharded_init.ForgetsUnbuiltModel",
        # Each step through the parallel axes set up on the rank (context parallelism's shard of each sequence,
        # pipeline stages' schedule): inside the mixins above (compile's eager sanity check wraps it), around
        # Lightning's step and backward.
        "lightning_dist.strategies.axis_steps.StepsThroughAxes"]
TORCH_REPLAY = "lightning_dist.strategies.torch.replay.ReplayedOnTorch"  # the dry run's replay of DDP and FSDP2
LIGHTNING = ["lightning.pytorch.strategies.parallel.ParallelStrategy", "lightning.pytorch.strategies.strategy.Strategy",
             "abc.ABC", "builtins.object"]
ORDERS = {
    "DDPStrategy": ["lightning_dist.strategies.torch.ddp.DDPStrategy", TORCH_REPLAY, *BASE,
                    "lightning.pytorch.strategies.ddp.DDPStrategy", *LIGHTNING],
    "FSDPStrategy": ["lightning_dist.strategies.torch.fsdp.FSDPStrategy", TORCH_REPLAY, *BASE,
                     "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy", *LIGHTNING],
    "DeepSpeedStrategy": ["lightning_dist.strategies.deepspeed.strategy.DeepSpeedStrategy", *BASE,
                          "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy",
                          "lightning.pytorch.strategies.ddp.DDPStrategy", *LIGHTNING],
}


@pytest.mark.parametrize("name", list(ORDERS))
def test_each_strategy_s_bases_keep_their_order(name):
    strategy = getattr(strategies, name)
    assert [f"{base.__module__}.{base.__qualname__}" for base in strategy.__mro__] == ORDERS[name]
