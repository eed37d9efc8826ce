"""scheduler=cosine_warmup in real 20-step runs: LearningRateMonitor's values equal the schedule's formula at every
step, and ddp and ZeRO-2 (whose engine steps the scheduler itself) train the same losses under it; FSDP's run in
scripts/extended_checks.sh."""

from __future__ import annotations

import math

import pytest

from tests.conftest import in_the_suite

pytestmark = pytest.mark.slow

STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2")
IN_THE_SUITE = ("ddp", "deepspeed_stage_2")
SCHEDULED = ("scheduler=cosine_warmup", "callbacks=[default,lr_monitor]", "trainer.log_every_n_steps=1")
STEPS, PEAK = 20, 1e-3  # ACCEPTANCE_OVERRIDES' max_steps; conf/optimizer/adamw.yaml's lr


def cosine_with_warmup(step: int) -> float:
    """conf/scheduler/cosine_warmup.yaml written out: warmup of 5% of 20 steps (1), then a half cosine to 0.1 x peak."""
    warmup = 1
    if step < warmup:
        return PEAK * (step + 1) / (warmup + 1)
    return PEAK * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup))))


@pytest.fixture(scope="module")
def scheduled(trained_runs):
    return lambda name: trained_runs(name, *SCHEDULED)


@pytest.mark.parametrize("name", in_the_suite(list(STRATEGIES), IN_THE_SUITE))
def test_the_logged_learning_rate_follows_the_formula_at_every_step(scheduled, name):
    run = scheduled(name)
    assert run.process.returncode == 0, run.output[-3000:]
    rows = run.csv_rows()
    columns = sorted(c for c in rows[0] if c.startswith("lr-"))
    assert len(columns) == 2, columns  # both parameter groups (decayed matrices, the rest) follow the schedule
    for column in columns:
        logged = {int(row["step"]): float(row[column]) for row in rows if row.get(column)}
        assert sorted(logged) == list(range(STEPS))
        assert [logged[s] for s in range(STEPS)] == pytest.approx([cosine_with_warmup(s) for s in range(STEPS)], rel=1e-6)


@pytest.mark.parametrize("name", in_the_suite(list(STRATEGIES[1:]), IN_THE_SUITE[1:]))
def test_each_strategy_trains_ddps_losses_under_the_schedule(scheduled, name):
    reference, curve = ({int(r["step"]): float(r["train_loss"]) for r in scheduled(n).csv_rows() if r.get("train_loss")}
                        for n in ("ddp", name))
    assert sorted(reference) == list(range(STEPS)) and curve.keys() == reference.keys()
    assert [curve[s] for s in reference] == pytest.approx(list(reference.values()), rel=1e-5)
