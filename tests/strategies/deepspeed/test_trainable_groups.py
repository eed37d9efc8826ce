"""The optimizer DeepSpeed is handed (strategies/deepspeed/trainable_groups.py), without DeepSpeed: its rules are
played by hand here, and the runs that meet them for real are in tests/models/test_finetune_runs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dist.strategies.deepspeed.trainable_groups import leave_frozen_weights_out, schedule_every_group


class SchedulerConfig:  # Lightning's LRSchedulerConfig, as far as these read it
    def __init__(self, scheduler):
        self.scheduler = scheduler


def lora_like() -> tuple[nn.Linear, nn.Linear, nn.LayerNorm]:
    base, adapter, norm = nn.Linear(4, 4).bfloat16(), nn.Linear(4, 4, bias=False), nn.LayerNorm(4)
    for parameter in (*base.parameters(), *norm.parameters()):
        parameter.requires_grad_(False)
    return base, adapter, norm


def test_frozen_weights_leave_every_group_and_the_first_parameter_is_one_that_trains():
    base, adapter, norm = lora_like()
    optimizer = torch.optim.AdamW([{"params": [*base.parameters(), adapter.weight]}, {"params": [*norm.parameters()]}])
    leave_frozen_weights_out(optimizer)
    assert [group["params"] for group in optimizer.param_groups] == [[adapter.weight], []]
    assert optimizer.param_groups[0]["params"][0].dtype == torch.float32  # what ZeRO takes its dtype from


def test_an_optimizer_of_frozen_weights_only_is_refused_in_one_line():
    base, _, _ = lora_like()
    with pytest.raises(ValueError, match=r"^configure_optimizers: every parameter of the AdamW it returns is frozen"):
        leave_frozen_weights_out(torch.optim.AdamW(base.parameters()))


def test_the_schedule_keeps_every_group_where_deepspeed_drops_an_empty_one():
    _, adapter, norm = lora_like()
    optimizer = torch.optim.AdamW([{"params": [adapter.weight]}, {"params": [*norm.parameters()]}], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: 0.5 ** step, lambda step: 3.0])
    leave_frozen_weights_out(optimizer)
    schedule_every_group(optimizer, SchedulerConfig(scheduler))
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]  # DeepSpeed's own trim
    optimizer.step()
    scheduler.step()  # torch 2.13: ValueError (zip() argument 2 is longer than argument 1) without the view
    assert optimizer.param_groups[0]["lr"] == 0.5  # the first group's own schedule, not moved onto another group
    assert scheduler.optimizer == optimizer and isinstance(scheduler.optimizer, torch.optim.AdamW)
    assert len(scheduler.optimizer.param_groups) == 2


def test_a_schedule_whose_groups_all_train_is_left_as_it_is():
    _, adapter, _ = lora_like()
    optimizer = torch.optim.AdamW([adapter.weight])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule_every_group(optimizer, SchedulerConfig(scheduler))
    assert scheduler.optimizer is optimizer
