"""A step that leaves parameters without gradients under ld_ddp (a GAN's generator in the discriminator's backward,
as Lightning's docs write a GAN) stops in one line naming them and this package's fix; with that fix it trains.
Lightning's own message named neither the parameters nor this strategy (its `ddp_find_unused_parameters_true` is
Lightning's DDP)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.strategies.deepspeed.test_one_optimizer import GAN_SCRIPT

pytestmark = pytest.mark.slow

# 2 optimizer steps a batch: 4 steps reach the second batch, whose forward finds the first one's reduction unfinished.
PLAIN = GAN_SCRIPT.replace('strategy="ld_deepspeed_stage_2"', 'strategy="ld_ddp"').replace("max_steps=2", "max_steps=4")
FIXED = PLAIN.replace('strategy="ld_ddp"', "strategy=lightning_dist.DDPStrategy(find_unused_parameters=True)")


def run(script: str, tmp_path) -> subprocess.CompletedProcess:
    (tmp_path / "gan.py").write_text(script + "    print('steps', trainer.global_step)\n")
    return subprocess.run([sys.executable, str(tmp_path / "gan.py")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)


def test_parameters_without_gradients_are_named_with_the_fix(tmp_path):
    process = run(PLAIN, tmp_path)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1].endswith(
        "RuntimeError: DDP: generator.weight, generator.bias got no gradient in the step's last backward, and DDP waits"
        " for every trainable parameter's: train with lightning_dist.DDPStrategy(find_unused_parameters=True)"
        " (train.py: +strategy.find_unused_parameters=true), or freeze them (requires_grad=False)")
    assert "ddp_find_unused_parameters_true" not in process.stderr


def test_the_fix_the_line_names_trains(tmp_path):
    process = run(FIXED, tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.strip().splitlines()[-1] == "steps 4"
