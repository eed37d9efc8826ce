"""recipes/lightning_hydra_template: a module of that template's shape (partial Adam, ReduceLROnPlateau on
`val/loss`, torchmetrics) run by a template-style train.py whose `trainer=` configs name our strategies."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, in_the_suite

pytestmark = pytest.mark.slow

TRAINERS = ["ld_ddp", "ld_fsdp", "ld_deepspeed_stage_2", "ld_deepspeed_stage_3"]
STRATEGY_CLASSES = {"ld_ddp": "DDPStrategy", "ld_fsdp": "FSDPStrategy"}


@pytest.mark.parametrize("trainer", in_the_suite(TRAINERS, ["ld_ddp", "ld_deepspeed_stage_3"]))
def test_plateau_scheduler_steps_on_the_validation_metric(trainer, tmp_path, deepspeed_ops):
    # mode=max with patience 0: every epoch whose val/loss falls is "no improvement", so the rate drops tenfold
    # after epochs 2 and 3; only a scheduler stepped with the logged metric does that.
    command = [
        sys.executable, str(REPO / "recipes" / "lightning_hydra_template" / "train.py"), f"trainer={trainer}",
        f"hydra.run.dir={tmp_path}", "data.samples=1024", "model.scheduler.mode=max", "model.scheduler.patience=0",
    ]
    process = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.returncode == 0, process.stderr[-3000:]
    report = json.loads((tmp_path / "schedule.json").read_text())
    assert report["strategy"] == STRATEGY_CLASSES.get(trainer, "DeepSpeedStrategy")
    assert report["scheduler"] == "ReduceLROnPlateau" and report["scheduler_steps"] == 3
    losses = report["val_losses"]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
    assert report["scheduler_best"] == pytest.approx(losses[0], rel=1e-6)
    assert report["lr"] == pytest.approx([1e-5])
    assert "'test/acc':" in process.stdout
