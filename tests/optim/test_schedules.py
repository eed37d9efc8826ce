"""Each schedule's multiplier, step by step, against its formula written out independently; bad lengths refused."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dist.optim import schedules


def lrs(scheduler, steps: int) -> list[float]:
    """The lr each of `steps` optimizer steps uses (read before the step, as Lightning's LearningRateMonitor does)."""
    optimizer = scheduler.optimizer
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_cosine_warms_up_then_follows_half_a_cosine_to_the_floor():
    seen = lrs(schedules.cosine(optimizer(2.0), total_steps=20, warmup_steps=4, min_lr_ratio=0.1), 20)
    expected = [2.0 * (s + 1) / 5 for s in range(4)] + [
        2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 16))) for s in range(4, 20)
    ]
    assert seen == pytest.approx(expected, rel=1e-12)


def test_linear_decays_on_a_straight_line_and_warmup_defaults_to_5_percent():
    seen = lrs(schedules.linear(optimizer(), total_steps=40), 40)
    assert seen[:2] == pytest.approx([1 / 3, 2 / 3])  # 5% of 40 = 2 warmup steps
    assert seen[2:] == pytest.approx([1 - (s - 2) / 38 for s in range(2, 40)])


def test_warmup_stable_decay_holds_the_peak_until_the_last_fifth():
    seen = lrs(schedules.warmup_stable_decay(optimizer(), total_steps=50, warmup_steps=5, decay="sqrt"), 50)
    assert seen[:5] == pytest.approx([(s + 1) / 6 for s in range(5)])
    assert seen[5:40] == [1.0] * 35
    assert seen[40:] == pytest.approx([1 - math.sqrt((s - 40) / 10) for s in range(40, 50)])


def test_constant_after_an_optional_warmup():
    assert lrs(schedules.constant(optimizer(0.5), warmup_steps=1), 4) == pytest.approx([0.25, 0.5, 0.5, 0.5])
    assert lrs(schedules.constant(optimizer(0.5)), 3) == [0.5, 0.5, 0.5]


def test_the_state_dict_is_plain_data_and_restores_the_position():
    scheduler = schedules.cosine(optimizer(), total_steps=10, warmup_steps=2)
    lrs(scheduler, 6)
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{"warmup_steps": 2, "stable_until": 2, "decay_steps": 8, "decay": "cosine", "min_lr_ratio": 0.0}]
    torch.save(state, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    restored = schedules.cosine(optimizer(), total_steps=10, warmup_steps=2)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize(("build", "message"), [
    (lambda o: schedules.cosine(o, total_steps=-1), r"^model.scheduler.total_steps: -1; .* set trainer.max_steps or model.scheduler.total_steps$"),
    (lambda o: schedules.linear(o, total_steps=10, warmup_steps=11), r"^model.scheduler.warmup_steps: 11 warmup and -1 decay steps"),
    (lambda o: schedules.warmup_stable_decay(o, total_steps=10, decay="exp"), r"^model.scheduler.decay: 'exp'; choose one of linear, cosine, sqrt$"),
    (lambda o: schedules.warmup_stable_decay(o, total_steps=10, decay_fraction=0), r"^model.scheduler.decay_fraction: 0 must be in \(0, 1\]$"),
])
def test_impossible_lengths_are_refused_naming_the_key(build, message):
    with pytest.raises(ValueError, match=message):
        build(optimizer())
