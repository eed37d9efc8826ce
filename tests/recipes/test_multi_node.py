"""recipes/multi_node: the plain sbatch script, run here under a stand-in srun (no SLURM on this machine), starts
both ranks itself, and a second attempt of the job (a requeue) continues from the first one's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lightning_dist.equivalence import read_train_losses
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "multi_node"


def submit(run_dir, max_steps: int) -> subprocess.CompletedProcess:
    """What SLURM would do with `sbatch train.sbatch`: the sbatch variables of a 1-node, 2-task job, then the script."""
    env = {
        **os.environ, "PATH": f"{RECIPE / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lightning-dist", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(REPO),
        "MASTER_PORT": str(free_port()), "RUN_DIR": str(run_dir), "TRAINER": "cpu",
    }
    command = ["bash", str(RECIPE / "train.sbatch"), f"trainer.max_steps={max_steps}", "callbacks.model_checkpoint.every_n_train_steps=3",
               "test=false", "trainer.log_every_n_steps=1"]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)


def test_sbatch_script_trains_with_srun_starting_the_ranks_and_a_requeue_resumes(tmp_path, deepspeed_ops):
    first = submit(tmp_path, max_steps=3)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"]) == (2, 3)
    # srun started both tasks; Lightning, reading SLURM's variables, took the job for a SLURM one and started no
    # process of its own (its launcher names a rank's Hydra log `*_process_N.log`). Rank 0 speaks for the run.
    assert "SLURM auto-requeueing enabled" in first.stdout + first.stderr
    assert not list(tmp_path.glob("*_process_*.log"))
    assert (first.stdout + first.stderr).count("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2") == 1
    assert "GLOBAL_RANK: 1" not in first.stdout + first.stderr
    assert sorted(read_train_losses(tmp_path)) == [0, 1, 2]

    second = submit(tmp_path, max_steps=5)  # the job started again, same script, same run directory
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 5
    assert "Restoring states from the checkpoint path at" in second.stderr + second.stdout
