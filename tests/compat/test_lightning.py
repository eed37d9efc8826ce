"""The functions lightning_dist/_compat/lightning.py puts in front of Lightning's internals, each doing what it says on
the installed Lightning (the fence test checks that the names exist; this, that they still mean the same)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_dist._compat import lightning as fence

pytestmark = pytest.mark.compat


def test_the_optimizer_inside_lightning_s_wrapper():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert fence.unwrapped_optimizer(LightningOptimizer(sgd)) is sgd and fence.unwrapped_optimizer(sgd) is sgd


def test_a_strategy_s_timeout_is_the_one_it_was_given():
    from lightning_dist.strategies import DDPStrategy, FSDPStrategy

    assert fence.strategy_timeout(DDPStrategy(timeout=42)) == timedelta(seconds=42)
    assert fence.strategy_timeout(FSDPStrategy(timeout=7)) == timedelta(seconds=7)
    assert fence.strategy_timeout(object()) is None
