"""Selective activation checkpointing under each kind of strategy: op-level (every block, its matrix products and
attention kept) and every k-th block train the eager losses, with the blocks the form names checkpointed; op-level
under ZeRO-3 is refused before launch."""

from __future__ import annotations

import json

import pytest

from lightning_dist.reports.equivalence import StrategyCurve, run_strategy
from tests.conftest import CURVE_OVERRIDES, in_the_suite

# Recomputation repeats the same float32 ops on the same inputs: the losses came out bit-identical to the eager
# curves (measured for every case below); 1e-5 is the bound the strategies' equivalence test uses.
RELATIVE_TOLERANCE = 1e-5
# The eager curve's first steps: with no scheduler, a shorter run follows the 30-step one exactly, step for step.
STEPS = 12
SHORTER = [*(o for o in CURVE_OVERRIDES if not o.startswith("trainer.max_steps=")), f"trainer.max_steps={STEPS}"]
CASES = [("ddp", "ops", 4), ("ddp", "2", 2), ("fsdp", "ops", 4), ("fsdp", "2", 2), ("deepspeed_stage_2", "ops", 4),
         ("deepspeed_stage_3", "2", 2)]


# In the suite: each form once (the rest: scripts/extended_checks.sh).
IN_THE_SUITE = [("ddp", "ops", 4), ("deepspeed_stage_3", "2", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name, form, checkpointed", in_the_suite(CASES, IN_THE_SUITE, unpack=True),
                         ids=[f"{n} {f}" for n, f, _ in CASES])
def test_selective_forms_train_the_eager_losses(name, form, checkpointed, curve_runs, tmp_path):
    run = run_strategy(name, [*SHORTER, f"strategy.activation_checkpointing={form}"], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(run.losses) == list(range(STEPS))
    eager = curve_runs(name)
    eager_start = StrategyCurve(name, {step: eager.losses[step] for step in range(STEPS)}, 0, eager.run_dir)
    assert run.max_relative_difference(eager_start) <= RELATIVE_TOLERANCE
    placement = json.loads((run.run_dir / "metrics.json").read_text())["placement_per_rank"]
    assert [rank["checkpointed_blocks"] for rank in placement] == [checkpointed, checkpointed]
