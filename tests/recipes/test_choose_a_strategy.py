"""recipes/choose_a_strategy: plan a 6.4B-parameter target on 8 devices, let auto_fit choose for three device
sizes, then sweep the candidates on the small model and compare them in the sweep report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, documented, run_documented

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
    assert "| per device | **total** | **22.663** |" in run.stdout
    assert "| fsdp_activation_checkpointing | 12.891 | 14.503 | 0.000 | 0.000 |" in run.stdout


@pytest.mark.parametrize(("options", "chosen"), [
    (["strategy.device_memory_gb=80"], "auto_fit: chose deepspeed_stage_2: 33.60 GB per device of 68.00 GB usable"),
    (["strategy.device_memory_gb=24", "strategy.host_memory_gb=512"], "auto_fit: chose deepspeed_stage_3_offload: 9.47 GB"),
    # The fsdp ladder's tensor-parallel rung: FSDP's 19.91 GB do not fit, split over 2 ranks as well they do.
    (["strategy.device_memory_gb=22", "strategy.host_memory_gb=512", "strategy.family=fsdp"],
     "auto_fit: chose fsdp_tp: 16.06 GB per device of 18.70 GB usable"),
])
def test_auto_fit_chooses_for_the_target(options, chosen):
    run = train(*TARGET, "strategy=auto_fit", *options)
    assert run.returncode == 0, run.stderr[-2000:]
    assert chosen in run.stdout + run.stderr


README = REPO / "recipes" / "choose_a_strategy" / "README.md"


# Four two-rank jobs (4 minutes of a loaded suite): in scripts/extended_checks.sh. The suite runs the README's own
# sweep and report as written (tests/run/test_multirun.py), the same launcher and report code.
@pytest.mark.extended
def test_sweep_of_the_candidates_and_its_report_as_written(tmp_path, deepspeed_ops):
    sweep_command = documented(README, "python train.py -m")
    process = run_documented(sweep_command, tmp_path)  # from a fresh directory, as typed: no hydra.sweep.dir
    assert process.returncode == 0, process.stderr[-2000:]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    report_command = documented(README, "python -m lightning_dist.sweep_report").replace("<date>", sweep.name)
    report = run_documented(report_command, tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    table = (sweep / "sweep_report.md").read_text()
    strategies = sweep_command.split("strategy=")[1].split()[0].split(",")
    for job, strategy in enumerate(strategies):
        assert f"| {job} | `strategy={strategy}` | finished |" in table
    # The losses are the same under every strategy (README: "identical to the digits shown").
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "`strategy=" in line]
    assert len({row[3] for row in rows}) == 1 and len({row[4] for row in rows}) == 1, table
    assert (sweep / "sweep_report.png").stat().st_size > 10_000
