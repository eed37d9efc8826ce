"""recipes/choose_a_strategy: plan a 6.4B-parameter target on 8 devices, let auto_fit choose for three device
sizes, then sweep the candidates on the small model and compare them in the sweep report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TARGET = ["--config-dir", str(REPO / "recipes" / "choose_a_strategy" / "conf"), "model=gpt_7b", "plan=true",
          "trainer.devices=8", "trainer.precision=bf16-mixed"]


def train(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_plan_of_the_target_lists_every_preset():
    run = train(*TARGET, "strategy=deepspeed_stage_3")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "All presets for 6,445,735,936 parameters, bf16-mixed, 8 ranks" in run.stdout
    assert "| per device | **total** | **23.196** |" in run.stdout
    assert "| fsdp_activation_checkpointing | 12.891 | 14.554 | 0.000 | 0.000 |" in run.stdout


@pytest.mark.parametrize(("options", "chosen"), [
    (["strategy.device_memory_gb=80"], "auto_fit: chose deepspeed_stage_2: 33.33 GB per device of 68.00 GB usable"),
    (["strategy.device_memory_gb=24", "strategy.host_memory_gb=512"], "auto_fit: chose deepspeed_stage_3_offload: 10.00 GB"),
    (["strategy.device_memory_gb=24", "strategy.host_memory_gb=512", "strategy.family=fsdp"], "auto_fit: chose fsdp_cpu_offload: 9.97 GB"),
])
def test_auto_fit_chooses_for_the_target(options, chosen):
    run = train(*TARGET, "strategy=auto_fit", *options)
    assert run.returncode == 0, run.stderr[-2000:]
    assert chosen in run.stdout + run.stderr


def test_sweep_of_the_candidates_and_its_report(tmp_path, deepspeed_ops):
    sweep = tmp_path / "sweep"
    run = train("-m", "strategy=ddp,deepspeed_stage_3", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 0, run.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "lightning_dist.sweep_report", str(sweep)], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert report.returncode == 0, report.stderr[-2000:]
    table = (sweep / "sweep_report.md").read_text()
    assert "| 0 | `strategy=ddp` | finished |" in table and "| 1 | `strategy=deepspeed_stage_3` | finished |" in table
    assert (sweep / "sweep_report.png").stat().st_size > 10_000
