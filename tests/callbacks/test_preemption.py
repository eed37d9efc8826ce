"""A preemption notice (SIGTERM, SLURM's --signal) mid-step: that step finishes, a checkpoint of it is saved, the job
exits with code 75, and `resume=true` continues exactly where the uninterrupted run went."""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from lightning_dist.callbacks import PREEMPTED_EXIT_CODE
from lightning_dist.checkpoints import load_consolidated
from lightning_dist.reports.equivalence import run_strategy
from lightning_dist.reports.summary_file import curve
from tests.conftest import CURVE_OVERRIDES, REPO, TRAIN_ENV, free_port, in_the_suite

pytestmark = pytest.mark.slow


def signal_at(step: int, signal: str = "SIGTERM") -> list[str]:
    return ["+callbacks.signal._target_=tests.probes.SignalAtStep", f"+callbacks.signal.global_step={step}",
            f"+callbacks.signal.signal={signal}"]


@pytest.mark.parametrize("name", in_the_suite(["ddp", "fsdp", "deepspeed_stage_3"], ["ddp"]))
def test_sigterm_saves_the_step_in_progress_and_resume_continues_the_curve(name, curve_runs, tmp_path):
    # The same command twice, as a scheduler reruns it: the first is told to stop during step 7.
    command = [*CURVE_OVERRIDES, *signal_at(7), "resume=true"]
    preempted = run_strategy(name, command, tmp_path / "runs" / "first")
    assert preempted.returncode == PREEMPTED_EXIT_CODE
    last = preempted.run_dir / "checkpoints" / "last.ckpt"
    # Step 7 finished (the checkpoint is of step 8's start), its loss logged before the save: together the two
    # runs hold every step once.
    assert load_consolidated(last)["global_step"] == 8
    assert sorted(preempted.losses) == list(range(8))
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # nothing partial left behind

    resumed = run_strategy(name, command, tmp_path / "runs" / "second")
    assert resumed.returncode == 0
    assert sorted(resumed.losses) == list(range(8, 30))
    uninterrupted = curve_runs(name)
    for step, loss in {**preempted.losses, **resumed.losses}.items():
        assert loss == pytest.approx(uninterrupted.losses[step], rel=1e-5), step


def test_under_slurm_the_notice_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    """SLURM simulated: its environment for one task, and an `scontrol` that records how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol_calls'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {**TRAIN_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    # The requeued job is the same script again: the same fixed run directory, continued by resume=true.
    run_dir = tmp_path / "runs" / "job_4242"
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", "trainer.devices=1",
               "trainer.max_steps=8", "trainer.log_every_n_steps=1", "test=false", "resume=true",
               *signal_at(3, "SIGUSR1")]

    def run():
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)

    first = run()
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert (f"preempted (SIGUSR1) at global step 4: saved {last}; continue with resume=true") in first.stderr
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 4242\n"  # once: ours, not Lightning's as well
    assert not list(run_dir.rglob("hpc_ckpt_*"))
    assert torch.load(last, weights_only=True)["global_step"] == 4
    first_config, first_summary = (run_dir / ".hydra" / "config.yaml").read_text(), (run_dir / "metrics.json").read_text()

    requeued = run()
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"resume=true: resuming from {last}" in requeued.stdout + requeued.stderr
    assert torch.load(last, weights_only=True)["global_step"] == 8
    # The directory holds both attempts, nothing replaced: the first's config and summary under the number 1, and
    # one CSV whose rows are the first attempt's steps, then the requeued one's, each once (the preemption writes
    # its step's row before it saves: Lightning's loggers would have written it after the hook that stops).
    assert (run_dir / ".hydra.1" / "config.yaml").read_text() == first_config
    assert (run_dir / "metrics.1.json").read_text() == first_summary
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "metrics.json").is_file()
    with open(run_dir / "csv" / "metrics.csv") as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train_loss")]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7], steps
    assert sorted(curve(json.loads(first_summary), "train_loss")) == [0, 1, 2, 3]
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 4242\n"  # finished: not requeued again
