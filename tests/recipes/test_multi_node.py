"""recipes/multi_node: the plain sbatch script, run here under a stand-in srun (no SLURM on this machine), starts
both ranks itself; a second attempt of the job (a requeue) continues from the first one's checkpoint, and the
script submitted again (a new job) trains afresh in a directory of its own."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "multi_node"


def submit(submit_dir: Path, job_id: int, max_steps: int) -> subprocess.CompletedProcess:
    """What SLURM would do with `sbatch recipes/multi_node/train.sbatch ...` typed in `submit_dir`: the sbatch
    variables of a 1-node, 2-task job, then the script, with its own default run directory."""
    env = {
        **os.environ, "PATH": f"{RECIPE / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "lightning-dist", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(submit_dir),
        "MASTER_PORT": str(free_port()), "TRAINER": "cpu",
    }
    command = ["bash", str(RECIPE / "train.sbatch"), f"trainer.max_steps={max_steps}", "callbacks.model_checkpoint.every_n_train_steps=3",
               "test=false", "trainer.log_every_n_steps=1"]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=submit_dir, timeout=600)


def test_sbatch_script_trains_with_srun_starting_the_ranks_a_requeue_resumes_and_a_new_job_starts_afresh(tmp_path, deepspeed_ops):
    (tmp_path / "train.py").symlink_to(REPO / "train.py")  # a checkout of the project, where users submit from
    first = submit(tmp_path, 4242, max_steps=3)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "logs" / "slurm" / "lightning-dist-4242"  # the script's default: one per job
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"]) == (2, 3)
    # srun started both tasks; Lightning, reading SLURM's variables, took the job for a SLURM one and started no
    # process of its own (its launcher names a rank's Hydra log `*_process_N.log`). Rank 0 speaks for the run.
    assert "SLURM auto-requeueing enabled" in first.stdout + first.stderr
    assert not list(run_dir.glob("*_process_*.log"))
    # Each task its own Hydra log (they appended to one train.log); one node, one config.
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log", "train.rank1.log"]
    assert sorted(p.name for p in run_dir.glob(".hydra*")) == [".hydra"]
    assert (first.stdout + first.stderr).count("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2") == 1
    assert "GLOBAL_RANK: 1" not in first.stdout + first.stderr
    assert sorted(read_train_losses(run_dir)) == [0, 1, 2]

    requeued = submit(tmp_path, 4242, max_steps=5)  # SLURM starts the same job again: same id, same directory
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"resume=run_dir: resuming from {run_dir / 'checkpoints'}" in requeued.stdout + requeued.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 5
    # Resumed from the end-of-run checkpoint of step 3, the CSV goes on labelling each loss with its global step.
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    logged = [(int(row["step"]), float(row["train_loss"])) for row in rows if row["train_loss"]]
    requeued_losses = read_train_losses(run_dir)  # the requeued attempt's, labelled by its own global steps
    assert [step for step, _ in logged] == [0, 1, 2, 3, 4] and sorted(requeued_losses) == [3, 4]
    assert [loss for step, loss in logged if step >= 3] == pytest.approx([requeued_losses[3], requeued_losses[4]])

    # The script submitted again is a new job: a new run that trains in full, never the finished one resumed.
    second_job = submit(tmp_path, 4243, max_steps=3)
    assert second_job.returncode == 0, second_job.stderr[-3000:]
    second_dir = tmp_path / "logs" / "slurm" / "lightning-dist-4243"
    assert "resume=run_dir: no complete checkpoint in" in second_job.stdout + second_job.stderr
    assert json.loads((second_dir / "metrics.json").read_text())["global_step"] == 3
    assert sorted(read_train_losses(second_dir)) == [0, 1, 2]
