"""Each strategy's bases, in their order: the mixins' hooks call on through `super()`, so their order is how they
nest around Lightning's own strategy (compile reports outermost; background saves hand their write to swapped saves,
which put it in place whole; the logged rows' step labels last). A reordering changes behaviour without failing any
single mixin's test: this pins it."""

from __future__ import annotations

import pytest

import lightning_dist.strategies as strategies

MIXINS = ["lightning_dist.parallel.regional_compile.ReportsCompilation",
          "lightning_dist.checkpoints.background.BackgroundSaves",
          "lightning_dist.checkpoints.swap.SwappedSaves",
          "lightning_dist.checkpoints.logged_steps.LogsGlobalSteps"]
LIGHTNING = ["lightning.pytorch.strategies.parallel.ParallelStrategy", "lightning.pytorch.strategies.strategy.Strategy",
             "abc.ABC", "builtins.object"]
ORDERS = {
    "DDPStrategy": ["lightning_dist.strategies.ddp.DDPStrategy", *MIXINS,
                    "lightning.pytorch.strategies.ddp.DDPStrategy", *LIGHTNING],
    "FSDPStrategy": ["lightning_dist.strategies.fsdp.FSDPStrategy", *MIXINS,
                     "lightning_dist.parallel.sharded_init.ForgetsUnbuiltModel",
                     "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy", *LIGHTNING],
    # No background saves: DeepSpeed's engine writes its checkpoints itself (strategies/refusals.py).
    "DeepSpeedStrategy": ["lightning_dist.strategies.deepspeed.DeepSpeedStrategy",
                          *(name for name in MIXINS if not name.endswith("BackgroundSaves")),
                          "lightning_dist.parallel.sharded_init.ForgetsUnbuiltModel",
                          "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy",
                          "lightning.pytorch.strategies.ddp.DDPStrategy", *LIGHTNING],
}


@pytest.mark.parametrize("name", list(ORDERS))
def test_each_strategy_s_bases_keep_their_order(name):
    strategy = getattr(strategies, name)
    assert [f"{base.__module__}.{base.__qualname__}" for base in strategy.__mro__] == ORDERS[name]
